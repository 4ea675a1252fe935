"""A run's output folder and provenance, shared by `python -m sim` and `python -m reference train`.

`prepare_out` is called once every input has been validated and before the run starts, so a bad
`--out` costs nothing: a file, a folder that cannot be created or written, or a non-empty folder
(unless `--overwrite`, which clears what is inside it) is one `UserError` naming the path, and nothing
is written. A default folder is created atomically, with `-2`, `-3`, ... appended when another run took
its name in the same second, so two runs never share a folder. `provenance` says what produced the
outputs: the policy, the command line, and the source (git commit and dirty flag in a checkout, else
the package version, plus a hash of the shipped config files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from core.cli import CTRL_C
from core.errors import UserError

ROOT = Path(__file__).resolve().parents[1]  # the repository root in a checkout, site-packages when installed
SHIPPED_CONFIGS = ("core/specs/*.yaml", "reference/configs/*.yaml", "sim/configs/*.yaml", "sim/configs/profiles/*.yaml")
PACKAGE = "seamlessflow-testbed"
GIT_TIMEOUT_S = 10.0


def default_out(kind: str, label: str, seed: int) -> Path:
    """results/<kind>-<label>-<time>-seed<seed>: `prepare_out` adds -2, -3, ... if it is taken."""
    return Path("results") / f"{kind}-{label}-{time.strftime('%Y%m%d-%H%M%S')}-seed{seed}"


def prepare_out(out: str | Path | None, default: Path, overwrite: bool = False) -> Path:
    """The run's output folder, empty and writable: `out` (the user's `--out`), or a new folder named
    after `default`. UserError, with nothing written, if `out` cannot be used."""
    if out is None:
        return _create_unique(default)
    out = Path(out)
    if out.exists():
        if not out.is_dir():
            raise UserError(f"--out {str(out)!r} is a file, not a folder")
        _check_writable(out)
        if _entries(out):
            if not overwrite:
                raise UserError(f"--out {str(out)!r} is not empty; choose a new folder or pass --overwrite")
            _clear(out)
        return out
    try:
        out.mkdir(parents=True)
    except OSError as e:
        raise UserError(f"--out {str(out)!r} cannot be created: {e.strerror}") from None
    return out


def _create_unique(base: Path) -> Path:
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                path.mkdir()  # atomic: of two runs that pick the same name, one gets FileExistsError
                return path
            except FileExistsError:
                continue
    except OSError as e:
        raise UserError(f"cannot create the output folder {str(base)!r}: {e.strerror}; choose one with --out") from None
    raise UserError(f"999 output folders named {str(base)!r}-<n> exist already; choose one with --out")


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError as e:
        raise UserError(f"--out {str(folder)!r} cannot be read: {e.strerror}") from None


def _check_writable(folder: Path) -> None:
    """Create and drop a nameless file: access() says yes to root even where writing fails."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UserError(f"--out {str(folder)!r} is not writable: {e.strerror}") from None


def _clear(folder: Path) -> None:
    """Remove what is inside `folder` (links themselves, never what they point to), refusing folders
    whose clearing would take more than a run's outputs with it."""
    reason = refusal_to_clear(folder)
    if reason:
        raise UserError(f"--overwrite refuses to clear {str(folder)!r}: it is {reason}")
    try:
        for entry in _entries(folder):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as e:
        raise UserError(f"--overwrite cannot clear {str(folder)!r}: {e.strerror} ({e.filename})") from None


def refusal_to_clear(folder: Path) -> str:
    """Why clearing `folder` would be a mistake ('' if it would not)."""
    target = folder.resolve()
    if target == Path(target.anchor):
        return "the filesystem root"
    protected = {"the current folder": Path.cwd(), "the repository root": ROOT}
    try:
        protected["the home folder"] = Path.home()
    except RuntimeError:  # no HOME and no password entry
        pass
    for name, path in protected.items():
        path = path.resolve()
        if target == path:
            return name
        if target in path.parents:
            return f"a folder holding {name}"
    if (target / ".git").exists():
        return "a git checkout"
    return ""


# ---- provenance ----


def provenance(policy: str, source: dict | None = None) -> dict:
    """What produced a run: the policy, the command line as given (`sys.argv`), and the source
    (`source_fingerprint()`, taken now unless given)."""
    return {"policy": policy, "argv": list(sys.argv), "source": source or source_fingerprint()}


def source_fingerprint() -> dict:
    """{git_commit, git_dirty} in a git checkout, else {version}; and configs_sha256 either way."""
    found = _git_state() or {"version": _package_version()}
    return {**found, "configs_sha256": configs_hash()}


def configs_hash(root: Path = ROOT) -> str:
    """sha256 over the shipped config files, each as its relative path and its bytes, in path order."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in SHIPPED_CONFIGS for p in root.glob(pattern)):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git_state() -> dict | None:
    if not (ROOT / ".git").exists():  # installed, not a checkout: an enclosing repository is not ours
        return None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    if commit is None or status is None:
        return None
    return {"git_commit": commit.strip(), "git_dirty": bool(status.strip())}


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def provenance_header(record: dict) -> str:
    """`record` as YAML comment lines (one JSON value a line), for a config file that must stay loadable."""
    lines = ["# How this run was made (comments: the file stays a config that --config accepts)."]
    lines += [f"# {key}: {json.dumps(value, sort_keys=True)}" for key, value in record.items()]
    return "\n".join(lines) + "\n"


# ---- the end of a run ----


def interrupted(out: Path | None, how: str = CTRL_C) -> str:
    """The line printed after Ctrl-C (or as `how` says the run stopped: `core.cli.run_main`'s `on_interrupt`):
    where the outputs written so far are, if any."""
    if out is not None and out.is_dir() and any(out.iterdir()):
        return f"{how}; outputs written so far are in {out}/"
    return f"{how}; no outputs were written"


def show_progress(requested: bool) -> bool:
    """Progress bars only on a terminal: a log or a pipe would collect every carriage-return frame."""
    return requested and sys.stderr.isatty()
