"""A task's environment: the image it names, the install recipe it carries, and the wheels that recipe needs.

Two optional fields of a task record (kept in `Task.extra`, so a record is written back as it was read):

    "image":   "python:3.12-slim"                  a Docker image used as is (pulled if absent)
    "install": {"pip": ["six==1.16.0"],            requirements, installed offline from wheels
                "commands": ["python -m six"]}     optional shell commands run after them at build time

A task with `install` runs in a task image built from its base (the task's `image`, else the run's
`--image`, else the offline base image) by `images.task_image`. The build itself has no network: the wheels
are put in a wheelhouse on this machine first, either a folder the user gives (`--wheelhouse DIR`, or
$SEAMLESSFLOW_WHEELHOUSE) or a cached folder filled once by `pip download` from the package index for the
base image's Python and platform (so the host's own Python does not matter). A requirement that cannot be
satisfied says so by name, in one line.

This module is the Docker-free half (the recipe, its validation, the wheelhouse on the host, the build's
context and script); `images.py` builds.
"""

from __future__ import annotations

import difflib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from core.errors import UserError

FIELDS = ("image", "install")  # the record fields read here (beyond SWE-bench's schema)
RECIPE_KEYS = ("pip", "commands")
WHEELHOUSE_ENV = "SEAMLESSFLOW_WHEELHOUSE"  # a folder of wheels to install from instead of the index
CACHE_ENV = "SEAMLESSFLOW_CACHE"  # where fetched wheels and build locks live (default ~/.cache/seamlessflow)
FETCH_TIMEOUT_S = 600.0
BUILD_DIR = "/tmp/seamlessflow-build"  # in the build container: wheels, requirements, the install script
STEP = ">>> seamlessflow build step:"  # the install script names each step, so a failure names its own
IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
# a PEP 508 requirement without a URL: name, optional [extras], optional version specifiers, optional ; marker
REQUIREMENT = re.compile(
    r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[A-Za-z0-9._,\s-]*\])?\s*"
    r"(\(?\s*(?:[<>=!~]=?|===)\s*[A-Za-z0-9.*+!_-]+(?:\s*,\s*(?:[<>=!~]=?|===)\s*[A-Za-z0-9.*+!_-]+)*\s*\)?)?"
    r"\s*(;[^@]*)?"
)
_MISSING = re.compile(r"No matching distribution found for ([^\s]+)")


class RecipeError(UserError):
    """A task's `image` or `install` field is malformed, or its recipe cannot be satisfied or built offline;
    the message (one line) names the field or the requirement and what is allowed."""


@dataclass(frozen=True)
class InstallRecipe:
    pip: tuple[str, ...] = ()  # requirement strings, pip's syntax without options or URLs ("six==1.16.0")
    commands: tuple[str, ...] = ()  # shell commands run (bash, no network) after the requirements are installed

    def to_json(self) -> dict[str, list[str]]:
        return {"pip": list(self.pip), "commands": list(self.commands)}


@dataclass(frozen=True)
class TaskEnvironment:
    image: str | None = None  # a Docker image the task runs in (or builds on); None: the run's default
    install: InstallRecipe | None = None  # None: no build, the image as it is


def environment_of(record: Mapping[str, Any]) -> TaskEnvironment:
    """The environment a task record (or a Task's `extra`) names; RecipeError for a malformed field."""
    image = record.get("image")
    if image is not None and (not isinstance(image, str) or (image and not IMAGE_NAME.fullmatch(image))):
        raise RecipeError(f"field 'image': expected a Docker image name such as 'python:3.11-slim', got {image!r:.80}")
    install = record.get("install")
    return TaskEnvironment(image or None, None if install is None else parse_recipe(install))


def parse_recipe(value: Any) -> InstallRecipe:
    """An `install` field's recipe; RecipeError naming the bad key or item and what is allowed."""
    shape = "an object with 'pip' (a list of requirements) and/or 'commands' (a list of shell commands)"
    if not isinstance(value, Mapping):
        raise RecipeError(f"field 'install': expected {shape}, got {type(value).__name__} {value!r:.60}")
    for key in value:
        if key not in RECIPE_KEYS:
            close = difflib.get_close_matches(str(key), RECIPE_KEYS, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RecipeError(f"field 'install': unknown key {key!r}{hint}; allowed: {', '.join(RECIPE_KEYS)}")
    pip, commands = (_strings(value, key) for key in RECIPE_KEYS)
    for i, requirement in enumerate(pip):
        if not REQUIREMENT.fullmatch(requirement.strip()):
            raise RecipeError(
                f"field 'install.pip' item {i}: {requirement!r} is not a requirement; give a name with optional "
                "extras, version and marker (e.g. 'six==1.16.0'), no pip options, URLs or paths"
            )
    if not pip and not commands:
        raise RecipeError(f"field 'install': empty; expected {shape}")
    return InstallRecipe(tuple(r.strip() for r in pip), commands)


def _strings(value: Mapping[str, Any], key: str) -> tuple[str, ...]:
    items = value.get(key, [])
    if not isinstance(items, list) or not all(isinstance(s, str) and s.strip() and "\n" not in s for s in items):
        raise RecipeError(f"field 'install.{key}': expected a list of non-empty one-line strings, got {items!r:.80}")
    return tuple(items)


# ---- the wheelhouse, on this machine ----


@dataclass(frozen=True)
class Target:
    """The interpreter wheels are chosen for: the base image's Python (e.g. "3.11") and platform tags."""

    python: str
    platforms: tuple[str, ...]  # e.g. ("manylinux_2_36_x86_64", "linux_x86_64"); pure wheels fit any


PROBE = (
    "import platform, sys, sysconfig; lib, version = platform.libc_ver(); "
    "print(sys.implementation.name, '%d.%d' % sys.version_info[:2], sysconfig.get_platform(), lib, version)"
)


def target_from_probe(output: str) -> Target:
    """Parse PROBE's output (`cpython 3.11 linux-x86_64 glibc 2.36`) into a Target."""
    words = output.split()
    if len(words) < 3 or words[0] != "cpython":
        raise RecipeError(f"install recipes need CPython in the base image; its python3 said {output.strip()!r:.120}")
    _, python, platform, *libc = words
    arch = platform.split("-", 1)[-1].replace("-", "_").replace(".", "_")
    platforms = [f"linux_{arch}"]
    if libc[:1] == ["glibc"] and len(libc) == 2:
        major, minor = libc[1].split(".")[:2]
        platforms.insert(0, f"manylinux_{major}_{minor}_{arch}")  # pip also accepts the older manylinux tags
    return Target(python, tuple(platforms))


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "seamlessflow")


def given_wheelhouse(path: Path | str | None) -> Path | None:
    """The wheelhouse folder a user gave (argument, else $SEAMLESSFLOW_WHEELHOUSE), checked; None if none."""
    path = path or os.environ.get(WHEELHOUSE_ENV)
    if not path:
        return None
    path = Path(path).resolve()
    if not path.is_dir():
        raise RecipeError(f"wheelhouse {path} is not a folder (from --wheelhouse or ${WHEELHOUSE_ENV})")
    return path


def fetched_wheels_dir(recipe: InstallRecipe, base_id: str) -> Path:
    """Where `pip download` puts the recipe's wheels for this base image (reused once complete)."""
    key = json.dumps({"pip": sorted(recipe.pip), "base": base_id}, sort_keys=True)
    return cache_dir() / "wheels" / hashlib.sha256(key.encode()).hexdigest()[:16]


def fetch_wheels(recipe: InstallRecipe, target: Target, dest: Path) -> Path:
    """`pip download` the recipe's requirements and their dependencies, as wheels for `target`, into `dest`
    (made atomically: a half-done download is never mistaken for a finished one). Needs the package index."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="fetch-", dir=dest.parent))
    platforms = [arg for p in target.platforms for arg in ("--platform", p)]
    abi = "cp" + target.python.replace(".", "")
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--only-binary=:all:",
        "--python-version",
        target.python,
        "--implementation",
        "cp",
        "--abi",
        abi,
        "--abi",
        "abi3",
        "--abi",
        "none",
        *platforms,
        "--dest",
        str(tmp),
        *recipe.pip,
    ]
    try:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RecipeError(f"pip download of {list(recipe.pip)} did not finish in {FETCH_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            raise RecipeError(pip_failure(done.stdout + done.stderr, f"the package index (Python {target.python})"))
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful replace
    return dest


def pip_failure(output: str, where: str) -> str:
    """One line for a failed pip run: the requirement it could not satisfy, else pip's last error line."""
    missing = _MISSING.search(output)
    if missing:
        return (
            f"requirement {missing.group(1)!r} cannot be installed offline: no wheel for it in {where}; "
            "add its wheel to a wheelhouse (pip wheel REQ -w DIR) and pass --wheelhouse DIR"
        )
    errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
    return f"pip failed ({where}): {(errors or [output.strip()[-300:] or 'no output'])[-1]}"


def wheel_files(folder: Path) -> list[Path]:
    """The wheel files of a wheelhouse, sorted by name."""
    return sorted(folder.glob("*.whl"), key=lambda p: p.name)


def wheels_digest(folder: Path) -> list[tuple[str, str]]:
    """(file name, sha256) of every wheel in `folder`: what a task image's tag is a hash of."""
    return [(p.name, _sha256(str(p), p.stat().st_size, p.stat().st_mtime_ns)) for p in wheel_files(folder)]


@lru_cache(maxsize=4096)
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a changed file is hashed again
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---- the build context ----


def build_context(name: str, base_id: str, recipe: InstallRecipe, wheels: Path | None) -> io.BytesIO:
    """The `docker build` context (a tar) of task image `name`: a Dockerfile from `base_id`, the wheels, the
    requirements and the install script; the build directory is removed in the same step that uses it."""
    copies = [f"COPY wheels/ {BUILD_DIR}/wheels/"] if wheels else []
    dockerfile = "\n".join(
        [
            f"FROM {base_id}",
            *copies,
            f"COPY install.sh requirements.txt {BUILD_DIR}/",
            f"RUN bash {BUILD_DIR}/install.sh && rm -rf {BUILD_DIR}",
            f'LABEL seamlessflow.task_image="{name.rsplit(":", 1)[1]}" seamlessflow.base="{base_id}"',
        ]
    )
    files = {"Dockerfile": dockerfile, "install.sh": install_script(recipe), "requirements.txt": "\n".join(recipe.pip)}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for file_name, text in files.items():
            data = (text + "\n").encode()
            info = tarfile.TarInfo(file_name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for wheel in wheel_files(wheels) if wheels else []:
            tar.add(wheel, arcname=f"wheels/{wheel.name}")
    buffer.seek(0)
    return buffer


def install_script(recipe: InstallRecipe) -> str:
    """The build's bash script: pip from the wheelhouse only, then each command; STEP lines name each step."""
    pip_env = "PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_NO_INPUT=1"
    lines = ["set -euo pipefail", f"export {pip_env} PIP_ROOT_USER_ACTION=ignore"]
    if recipe.pip:
        wheels, requirements = f"{BUILD_DIR}/wheels", f"{BUILD_DIR}/requirements.txt"
        lines += [f'echo "{STEP} pip"', f"python3 -m pip install --no-index --find-links {wheels} -r {requirements}"]
    for i, command in enumerate(recipe.commands):
        lines += [f'echo "{STEP} command {i}"', f"bash -euo pipefail -c {shlex.quote(command)}"]
    return "\n".join(lines)
