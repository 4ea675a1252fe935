"""core.cli: a user's mistake is one `error:` line and exit code 2, a named failure one line and 1, Ctrl-C one line
and 130, SIGTERM under `stop_on_sigterm` one line and 143; anything else is a bug and keeps its traceback. The
config and output arguments parse as every command documents them."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from core.cli import (
    CTRL_C,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Terminated,
    add_config_args,
    add_out_args,
    run_main,
    stop_on_sigterm,
)
from core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


def raising(exc: BaseException):
    def body() -> int:
        raise exc

    return body


def test_the_body_s_exit_code_is_returned_and_nothing_printed(capsys):
    assert run_main(lambda: 0) == 0
    assert run_main(lambda: 1) == 1
    assert capsys.readouterr().err == ""


def test_a_user_error_is_one_error_line_and_exit_code_2(capsys):
    assert run_main(raising(UserError("--steps must be >= 1, got 0"))) == EXIT_USAGE == 2
    assert capsys.readouterr().err == "error: --steps must be >= 1, got 0\n"


def test_prog_prefixes_the_error_line_as_argparse_does(capsys):
    assert run_main(raising(UserError("--out exists")), prog="gpu_calibration") == 2
    assert capsys.readouterr().err == "gpu_calibration: error: --out exists\n"


def test_the_usage_errors_are_the_command_s_choice(capsys):
    assert run_main(raising(FileNotFoundError("no such file: x.json")), usage_errors=(ValueError, OSError)) == 2
    assert capsys.readouterr().err == "error: no such file: x.json\n"


def test_a_named_failure_is_one_line_and_exit_code_1(capsys):
    assert run_main(raising(RuntimeError("git clone failed")), failures=(RuntimeError,)) == EXIT_FAILED == 1
    assert capsys.readouterr().err == "error: git clone failed\n"


def test_ctrl_c_is_one_line_and_exit_code_130(capsys):
    assert run_main(raising(KeyboardInterrupt())) == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == f"{CTRL_C}\n"


def test_on_interrupt_gives_the_line_from_how_the_run_stopped(capsys):
    assert run_main(raising(KeyboardInterrupt()), on_interrupt=lambda how: f"{how}; outputs in out/") == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C); outputs in out/\n"
    assert run_main(raising(Terminated()), on_interrupt=lambda how: f"{how}; outputs in out/") == EXIT_TERMINATED
    assert capsys.readouterr().err == "stopped (SIGTERM); outputs in out/\n"


def test_an_unexpected_exception_is_a_bug_and_propagates(capsys):
    with pytest.raises(ZeroDivisionError):
        run_main(raising(ZeroDivisionError("division by zero")))
    with pytest.raises(KeyError):  # not a usage error unless named: KeyError is no ValueError
        run_main(raising(KeyError("x")), failures=(RuntimeError,))
    assert capsys.readouterr().err == ""


def test_a_runtime_error_is_a_bug_unless_the_command_names_it():
    with pytest.raises(RuntimeError):
        run_main(raising(RuntimeError("an invariant broke")))


def test_argparse_s_own_exit_passes_through():
    with pytest.raises(SystemExit) as exit_:
        run_main(raising(SystemExit(2)))
    assert exit_.value.code == 2


def test_sigterm_under_stop_on_sigterm_is_one_line_and_143_and_the_old_handler_comes_back(capsys):
    before = signal.getsignal(signal.SIGTERM)

    def body() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the body")

    with stop_on_sigterm():
        assert run_main(body) == 143
    assert capsys.readouterr().err == "stopped (SIGTERM)\n"
    assert signal.getsignal(signal.SIGTERM) is before


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cmd")
    add_config_args(p, default_config="sim/configs/default.yaml", example="cluster.num_gpus=128")
    add_out_args(p, default="results/cmd-<time>")
    return p


def test_config_and_set_are_repeatable_and_in_order():
    args = parser().parse_args(["--config", "a.yaml", "--set", "x=1", "--config", "b.yaml", "--set", "y.z=2"])
    assert args.config == ["a.yaml", "b.yaml"]
    assert args.overrides == ["x=1", "y.z=2"]


def test_without_arguments_no_config_no_override_no_out():
    args = parser().parse_args([])
    assert (args.config, args.overrides, args.out, args.overwrite) == (None, [], None, False)


def test_out_is_a_path_and_overwrite_a_flag():
    args = parser().parse_args(["--out", "results/x", "--overwrite"])
    assert args.out == Path("results/x")
    assert args.overwrite is True


def test_the_help_names_the_shipped_config_the_example_and_the_default_folder(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "YAML merged over sim/configs/default.yaml" in help_text
    assert "e.g. --set cluster.num_gpus=128" in help_text
    assert "(default: results/cmd-<time>)" in help_text


def test_out_without_a_default_is_required(capsys):
    p = argparse.ArgumentParser(prog="cmd")
    add_out_args(p, default=None)
    with pytest.raises(SystemExit) as exit_:
        p.parse_args([])
    assert exit_.value.code == 2
    assert "the following arguments are required: --out" in capsys.readouterr().err


def _run_until_the_reader_goes(code: str) -> tuple[int, str]:
    """Runs `code` in a Python process whose stdout's reader reads one line and goes away (`| head -1`)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_a_reader_of_stdout_that_goes_away_ends_the_command_quietly_with_141():
    """`python -m sim ... | head -1`: no BrokenPipeError traceback, no 'Exception ignored' at exit; 141, as a shell
    tool killed by SIGPIPE reports."""
    code = (
        "import sys; from core.cli import run_main\n"
        "sys.exit(run_main(lambda: [print('x' * 99) for _ in range(10**6)] and 0))"
    )
    assert _run_until_the_reader_goes(code) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_keeps_its_traceback():
    """A pipe of the command's own (its reader gone) while stdout's reader is still there: a bug's traceback."""
    code = (
        "import os, sys; from core.cli import run_main\n"
        "def body():\n"
        "    print('started', flush=True)\n"
        "    r, w = os.pipe(); os.close(r); os.write(w, b'x')\n"
        "sys.exit(run_main(body))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 1 and done.stdout == "started\n", done
    assert "Traceback" in done.stderr and "BrokenPipeError" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        (int, "0", "must be an integer >= 1, got '0'"),
        (int, "1.5", "must be an integer >= 1, got '1.5'"),
        (float, "nan", "must be a number >= 1, got 'nan'"),
        (float, "inf", "must be a number >= 1, got 'inf'"),
        (float, "0.99", "must be a number >= 1, got '0.99'"),
    ],
)
def test_at_least_refuses_what_is_out_of_range_naming_the_value(kind, text, message):
    from core.cli import at_least

    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
        at_least(1, kind)(text)


def test_at_least_and_list_of_take_what_is_in_range():
    from core.cli import at_least, list_of

    assert at_least(1)("3") == 3 and at_least(0.0, float, below=1.0)("0.25") == 0.25
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be a number in \[0.0, 1.0\), got '1'$"):
        at_least(0.0, float, below=1.0)("1")
    assert list_of(at_least(0))("0, 5,7") == [0, 5, 7]
