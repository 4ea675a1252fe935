"""`python -m sim`'s outputs: `--out` checked before simulating (one `error:` line, exit 2, nothing written),
`--overwrite`, unique default folders, provenance in config.yaml, Ctrl-C as one line and exit 130."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sim.cli import main
from sim.config import load_config
from sim.runner import Simulation

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "cluster.num_gpus=32", "--set", "workload.prompts_per_step=16", "--set", "model=qwen3-8b",
         "--set", "rollout.tensor_parallel=2", "--set", "num_steps=1", "--quiet", "--no-picture"]  # fmt: skip
OUTPUTS = ["config.yaml", "intervals.json", "summary.json", "timeline.json"]


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def no_simulation(monkeypatch):
    """A simulation that fails the test if it starts: these mistakes must be caught before any runs."""

    def run(self):
        raise AssertionError("the simulation started")

    monkeypatch.setattr(Simulation, "run", run)


def header(config_yaml: Path) -> dict:
    """The provenance comments at the top of a config.yaml, parsed."""
    lines = [line for line in config_yaml.read_text().splitlines() if line.startswith("# ")][1:]
    return {key: json.loads(value) for key, value in (line[2:].split(": ", 1) for line in lines)}


def test_an_out_that_is_a_file(capsys, tmp_path, no_simulation):
    (tmp_path / "run").write_text("mine")
    assert main([*SMALL, "--out", str(tmp_path / "run")]) == 2
    assert one_error_line(capsys) == f"error: --out '{tmp_path}/run' is a file, not a folder"
    assert tree(tmp_path) == ["run"]
    assert (tmp_path / "run").read_text() == "mine"


def test_an_out_that_cannot_be_created(capsys, tmp_path, no_simulation):
    (tmp_path / "file").write_text("mine")
    assert main([*SMALL, "--out", str(tmp_path / "file" / "run")]) == 2
    assert one_error_line(capsys) == f"error: --out '{tmp_path}/file/run' cannot be created: Not a directory"
    assert tree(tmp_path) == ["file"]


@pytest.mark.parametrize("compare", [False, True])
def test_a_non_empty_out_is_refused(capsys, tmp_path, no_simulation, compare):
    (tmp_path / "summary.json").write_text("{}")
    argv = [*SMALL, "--out", str(tmp_path), *(["--compare"] if compare else [])]
    assert main(argv) == 2
    assert one_error_line(capsys) == f"error: --out '{tmp_path}' is not empty; choose a new folder or pass --overwrite"
    assert tree(tmp_path) == ["summary.json"]


def test_overwrite_refuses_the_current_folder(capsys, tmp_path, monkeypatch, no_simulation):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert main([*SMALL, "--out", ".", "--overwrite"]) == 2
    assert one_error_line(capsys) == "error: --overwrite refuses to clear '.': it is the current folder"
    assert tree(tmp_path) == ["notes.txt"]


def test_a_config_mistake_writes_no_folder(capsys, tmp_path, monkeypatch):
    """The model-fit check runs before the output folder is made (before, it ran inside the simulation)."""
    monkeypatch.chdir(tmp_path)
    assert main(["--quiet", "--policy", "async", "--set", "cluster.num_gpus=4"]) == 2
    assert "policy 'async' needs at least 2 resources" in one_error_line(capsys)
    assert tree(tmp_path) == []


def test_overwrite_replaces_the_last_runs_outputs(capsys, tmp_path):
    out = tmp_path / "run"
    assert main([*SMALL[:-1], "--out", str(out)]) == 0  # with timeline.png
    assert "timeline.png" in tree(out)
    assert main([*SMALL, "--out", str(out), "--overwrite", "--set", "seed=1"]) == 0
    assert tree(out) == OUTPUTS  # no timeline.png of the last run beside the new summary
    assert load_config(out / "config.yaml").seed == 1


def test_default_folders_never_collide(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for seed in (0, 0, 1):
        assert main([*SMALL, "--set", f"seed={seed}"]) == 0
    folders = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert len(folders) == 3
    assert [name.startswith("sim-tag-") for name in folders] == [True] * 3
    assert sum("-seed0" in name for name in folders) == 2
    assert sum(name.endswith("-seed1") for name in folders) == 1
    printed = capsys.readouterr().out
    for name in folders:
        assert tree(tmp_path / "results" / name) == OUTPUTS
        assert f"outputs: results/{name}/" in printed


def test_config_yaml_records_the_policy_the_command_and_the_source(capsys, tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    argv = [*SMALL, "--compare", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["sim/__main__.py", *argv])
    assert main(argv) == 0
    for policy in ("async", "colocated", "disaggregated", "tag"):
        record = header(out / policy / "config.yaml")
        assert record["policy"] == policy
        assert record["argv"] == ["sim/__main__.py", *argv]
        assert len(record["source"]["configs_sha256"]) == 64
        assert "git_commit" in record["source"] or "version" in record["source"]
        # still a config --config accepts: the comments do not change what it loads
        assert load_config(out / policy / "config.yaml") == load_config(out / "tag" / "config.yaml")


def test_outputs_other_than_the_provenance_are_byte_identical(capsys, tmp_path):
    for name in ("a", "b"):
        assert main([*SMALL, "--out", str(tmp_path / name)]) == 0
    for name in ("summary.json", "intervals.json", "timeline.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    configs = [(tmp_path / name / "config.yaml").read_text().splitlines() for name in ("a", "b")]
    assert [line for line in configs[0] if not line.startswith("#")] == [
        line for line in configs[1] if not line.startswith("#")
    ]


def test_ctrl_c_in_process_is_one_line_and_130(capsys, tmp_path, monkeypatch):
    def run(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "run", run)
    assert main([*SMALL, "--out", str(tmp_path / "run")]) == 130
    captured = capsys.readouterr()
    assert captured.err == "config: sim/configs/default.yaml\ninterrupted (Ctrl-C); no outputs were written\n"
    assert captured.out == ""
    assert not (tmp_path / "run").exists()  # the folder the run made, still empty, is gone


def test_ctrl_c_leaves_a_folder_the_user_made_and_one_with_outputs(capsys, tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()

    def run(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Simulation, "run", run)
    assert main([*SMALL, "--out", str(tmp_path / "mine")]) == 130
    assert (tmp_path / "mine").is_dir()
    monkeypatch.undo()
    calls = []
    real = Simulation.run

    def second_interrupted(self):
        calls.append(self.policy.name)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Simulation, "run", second_interrupted)
    assert main([*SMALL, "--compare", "--out", str(tmp_path / "cmp")]) == 130
    assert "outputs written so far are in" in capsys.readouterr().err
    assert (tmp_path / "cmp" / calls[0] / "summary.json").is_file()


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def test_ctrl_c_in_python_dash_m_sim_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "run"
    # A run far too long to finish: it is interrupted once its output folder exists (the simulation is starting).
    argv = [sys.executable, "-m", "sim", "--set", "num_steps=1000000", "--out", str(out)]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as in a terminal: a shell's background jobs (a CI runner's) inherit SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_for(lambda: out.is_dir() or proc.poll() is not None, 120, "the output folder")
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    note, line = stderr.splitlines()
    assert note == "config: sim/configs/default.yaml"
    assert line == "interrupted (Ctrl-C); no outputs were written", stderr
    assert stdout == ""
    assert not out.exists()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stderr", "shown"), [(Terminal(), True), (io.StringIO(), False)])
def test_the_progress_bar_only_on_a_terminal(monkeypatch, stderr, shown):
    """A log or a pipe gets no carriage-return frames."""
    monkeypatch.setattr(sys, "stderr", stderr)
    cfg = load_config(overrides=[arg for arg in SMALL if "=" in arg])
    assert Simulation.from_config(cfg, "tag", progress=True).progress is shown
