"""Git as a subprocess, isolated from the user's configuration and with a timeout on every call.

Every call runs with `GIT_CONFIG_GLOBAL=/dev/null` and `GIT_CONFIG_NOSYSTEM=1`, so a user's
`commit.gpgsign`, `init.defaultBranch`, hooks or diff drivers cannot change what the suite generator
writes: with the fixed author, committer and dates of `deterministic_env`, a commit of the same tree
hashes the same on every machine.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

DEFAULT_TIMEOUT_S = 120.0
AUTHOR = ("SWE Suite", "suite@example.invalid")


class GitError(RuntimeError):
    """A git command failed or timed out; the message holds the command and git's own words."""


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The process environment for git: the caller's, minus global and system config, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    env.update(extra or {})
    return env


def deterministic_env(date: str) -> dict[str, str]:
    """Author and committer identity and `date` (e.g. "2024-01-01T12:00:00+00:00") fixed for both roles."""
    name, email = AUTHOR
    return base_env(
        {
            "GIT_AUTHOR_NAME": name,
            "GIT_AUTHOR_EMAIL": email,
            "GIT_AUTHOR_DATE": date,
            "GIT_COMMITTER_NAME": name,
            "GIT_COMMITTER_EMAIL": email,
            "GIT_COMMITTER_DATE": date,
        }
    )


def git(
    *args: str,
    cwd: Path | str,
    env: Mapping[str, str] | None = None,
    input_text: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Run `git ARGS` in `cwd` and return its stdout; raise GitError on a non-zero exit or a timeout."""
    cmd = ["git", *args]
    try:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=dict(env) if env is not None else base_env(),
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        raise GitError(f"`{' '.join(cmd)}` in {cwd} timed out after {timeout_s:g} s") from e
    except FileNotFoundError as e:
        raise GitError("git is not installed (needed to check out task repositories)") from e
    if done.returncode != 0:
        raise GitError(f"`{' '.join(cmd)}` in {cwd} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def is_repository(path: Path) -> bool:
    """Whether `path` is a git work tree (has `.git`) or a bare repository (`HEAD` and `objects/`)."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())
