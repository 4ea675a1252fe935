"""What every command line of the project shares: the config and output arguments, and the exit codes.

`add_config_args` adds `--config FILE` (repeatable: merged in order over the command's shipped config) and
`--set KEY=VALUE` (repeatable, into `args.overrides`); `add_out_args` adds `--out DIR` (new or empty, see
`core.outputs.prepare_out`) and `--overwrite`. `run_main` runs a command's body and turns how it ended into an
exit code: a user's mistake is one `error:` line on stderr and 2 (as argparse's own), a failure the command
names (not the user's typing: a task that cannot be built) one line and 1, Ctrl-C one line and 130, SIGTERM
under `stop_on_sigterm` one line and 143, and a reader of stdout that went away (`| head`) nothing and 141, as a
shell tool ends. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from core.errors import UserError

EXIT_FAILED, EXIT_USAGE = 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # 128 + the signal's number, as a shell reports a killed command
EXIT_PIPE = 141  # 128 + SIGPIPE: stdout's reader went away
CTRL_C, SIGTERM = "interrupted (Ctrl-C)", "stopped (SIGTERM)"  # how a stopped run's line begins

Errors = tuple[type[BaseException], ...]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a service manager, `docker stop`, `kill`) under `stop_on_sigterm`: a run stops as Ctrl-C stops
    it (`finally` blocks run: sandboxes removed, processes stopped), with exit code 143."""


def add_config_args(
    parser: argparse.ArgumentParser,
    *,
    default_config: str,
    example: str,
    what: str = "a config key",
    note: str = "",
) -> None:
    """`--config FILE` (repeatable; `args.config` is None when not given) merged over `default_config`, and
    `--set KEY=VALUE` (repeatable; `args.overrides`, a list). `what` names what a `--set` overrides, `example`
    is one KEY=VALUE, `note` adds to --config's help how the files merge."""
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="FILE",
        help=f"YAML merged over {default_config} (repeatable: later files win key by key{note})",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {what}, e.g. --set {example} (repeatable)",
    )


def in_range(
    kind: type, low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], int | float]:
    """An argparse `type=` for a number of `kind` (int or float; floats finite) between `low` and `high` (None: no
    upper bound), each bound included unless open: a value out of range is argparse's one-line error and exit code
    2, naming the value and what is allowed."""
    what = "an integer" if kind is int else "a number"
    if high is None:
        allowed = f"{'>' if low_open else '>='} {low}"
    else:
        allowed = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {allowed}, got {text!r}") from None
        top = math.inf if high is None else high
        above = value > low if low_open else value >= low
        below = value < top if high_open or high is None else value <= top  # inf and NaN fail here
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be {what} {allowed}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} {allowed}"  # what argparse names in its own messages
    return parse


def at_least(low: float, kind: type = int, below: float | None = None) -> Callable[[str], int | float]:
    """`in_range`: a number of `kind` >= `low` (and < `below` where given)."""
    return in_range(kind, low, below, high_open=True)


def greater_than(low: float, kind: type = float) -> Callable[[str], int | float]:
    """`in_range`: a number of `kind` > `low`, e.g. a positive number of seconds."""
    return in_range(kind, low, low_open=True)


def list_of(item: Callable[[str], int | float]) -> Callable[[str], list]:
    """An argparse `type=` for a comma-separated list, each entry parsed by `item` (e.g. `at_least(0)`): a bad entry
    is argparse's one-line error, naming it."""

    def parse(text: str) -> list:
        entries = [part.strip() for part in text.split(",")]
        if not all(entries):
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
        try:
            return [item(part) for part in entries]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"each entry {e}") from None

    parse.__name__ = "list"
    return parse


def add_out_args(parser: argparse.ArgumentParser, *, default: str | None, what: str = "output folder") -> None:
    """`--out DIR` (a Path; None when not given) and `--overwrite`. `default` says which folder a run without
    --out writes; None makes --out required."""
    shown = "" if default is None else f" (default: {default})"
    parser.add_argument(
        "--out", type=Path, default=None, required=default is None, metavar="DIR", help=f"{what}, new or empty{shown}"
    )
    parser.add_argument("--overwrite", action="store_true", help="clear a non-empty --out folder first")


def run_main(
    body: Callable[[], int],
    *,
    usage_errors: Errors = (UserError,),
    failures: Errors = (),
    on_interrupt: Callable[[str], str] | None = None,
    prog: str | None = None,
) -> int:
    """`body()`'s exit code, or: 2 and one `error:` line for `usage_errors` (a user's mistake), 1 and one line for
    `failures`, 130 after Ctrl-C and 143 after SIGTERM (`Terminated`) with one line: `on_interrupt(how)`, given
    how the run stopped (CTRL_C or SIGTERM), else that phrase alone. `prog` prefixes the error line, as
    argparse does. Any other exception propagates: a bug, whose traceback is wanted."""
    label = "error" if prog is None else f"{prog}: error"
    try:
        return body()
    except usage_errors as e:
        print(f"{label}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except failures as e:
        print(f"{label}: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        how = SIGTERM if isinstance(e, Terminated) else CTRL_C
        print(how if on_interrupt is None else on_interrupt(how), file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # a socket's or another pipe's: a failure of the command's own
        return EXIT_PIPE


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (its pipe or socket reports an error or a hang-up); if so, stdout is pointed
    at /dev/null, so that the interpreter's own flush at exit does not complain about it again."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        gone = any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file behind stdout, or no poll here
        return False
    if gone:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    return gone


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside: SIGTERM raises `Terminated` in the main thread (`run_main` makes it exit code 143). The
    previous handler is back afterwards."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame) -> None:
    raise Terminated()
