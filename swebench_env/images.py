"""Sandbox images: a Debian base image built offline, and official SWE-bench instance images.

**Base image.** `debootstrap --variant=minbase` installs Debian packages from the configured mirror
into a folder (python3 with pytest, pip, venv and setuptools from Debian, since a sandbox has no
network to pip-install from; git, patch, procps, coreutils' `timeout`), the folder is trimmed (apt
caches, docs, translations) and imported with `docker import`. No registry is involved, so it builds
where Docker Hub is unreachable. The tag is a hash of the recipe (suite, variant, packages, trim list,
`SCRIPT_VERSION`): an image with that tag is reused, so the build (about a minute or two) happens once
per machine and again only when the recipe changes. The mirror is not part of the hash (any mirror of
the suite gives the same image); nor is time, so a rebuild months later may get newer package versions
under the same tag. Downloaded .deb files are kept in `DEBOOTSTRAP_CACHE` (default
/var/cache/seamlessflow/debootstrap, override with $SEAMLESSFLOW_DEBOOTSTRAP_CACHE), so a rebuild does
not download again. Building needs root (debootstrap); elsewhere, name a prebuilt image with
$SEAMLESSFLOW_SWE_BASE_IMAGE or `ensure_base_image(image=...)`.

**SWE-bench images.** `swebench_image_name` follows SWE-bench's harness
(`swebench/harness/test_spec/test_spec.py`, `TestSpec.instance_image_key`, with the `swebench`
namespace that its run_evaluation uses by default): `sweb.eval.<arch>.<instance id, lower case>:latest`
under the namespace, with every `__` replaced by `_1776_` because Docker Hub rejects `__` in names.
E.g. django__django-11099 -> swebench/sweb.eval.x86_64.django_1776_django-11099:latest. Those images
hold the repository at /testbed with a conda environment `testbed`; `ensure_swebench_image` pulls one
when it is not present locally.

**Task images.** `task_image(task)` is how every caller picks the image a task runs in: an official
SWE-bench record keeps its own image (above); another task runs in the image its `image` field names
(used as is, pulled if absent), else the run's default (`--image`), else the base image; and when it
carries an `install` recipe (`environments.py`), in a task image built on that one: `docker build` with
the network off copies a wheelhouse in, runs `pip install --no-index --find-links` and the recipe's
commands, and tags the result `seamlessflow/swe-task:<hash>` of (base image id, recipe, wheel files), so
it is built once per machine and reused. A file lock per tag keeps concurrent builders from racing.

Task repositories get into a sandbox by copying: `sandbox_files.copy_in(sandbox, checkout, "/testbed")`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from swebench_env.docker_util import docker_client
from swebench_env.environments import (
    PROBE,
    STEP,
    InstallRecipe,
    RecipeError,
    build_context,
    cache_dir,
    fetch_wheels,
    fetched_wheels_dir,
    given_wheelhouse,
    pip_failure,
    target_from_probe,
    wheels_digest,
)
from swebench_env.tasks import is_official

if TYPE_CHECKING:
    from swebench_env.tasks import Instance

log = logging.getLogger(__name__)

SCRIPT_VERSION = 1  # bump when the build steps change in a way that changes the image
BASE_IMAGE_ENV = "SEAMLESSFLOW_SWE_BASE_IMAGE"
CACHE_ENV = "SEAMLESSFLOW_DEBOOTSTRAP_CACHE"
MIRROR_ENV = "SEAMLESSFLOW_DEBIAN_MIRROR"
DEBOOTSTRAP_CACHE = Path("/var/cache/seamlessflow/debootstrap")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
BUILD_TIMEOUT_S = 1800.0
PACKAGES = (
    "python3",
    "python-is-python3",  # `python` runs the tests, as evaluation.pytest_command writes them
    "python3-pytest",
    "python3-pip",
    "python3-venv",
    "python3-setuptools",
    "python3-wheel",
    "git",
    "patch",
    "procps",
    "ca-certificates",
)
TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/info")
TRIM += ("usr/share/locale",)
IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    "WORKDIR /",
    'CMD ["bash"]',
)


TASK_REPOSITORY = "seamlessflow/swe-task"
TASK_SCRIPT_VERSION = 1  # bump when the task image's build steps change
INSTALL_TIMEOUT_S = 1800.0


class ImageUnavailable(RuntimeError):
    """An image could not be found, pulled or built; the message says why and what to do instead."""


@dataclass(frozen=True)
class BaseImageRecipe:
    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = PACKAGES
    repository: str = "seamlessflow/swe-base"

    def digest(self) -> str:
        """12 hex digits of a hash of everything that shapes the image (not the mirror, not the name)."""
        recipe = {**asdict(self), "packages": sorted(self.packages), "trim": TRIM, "changes": IMAGE_CHANGES}
        recipe |= {"script_version": SCRIPT_VERSION}
        del recipe["repository"]
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def image(self) -> str:
        return f"{self.repository}:{self.suite}-{self.digest()}"


def ensure_base_image(recipe: BaseImageRecipe | None = None, *, image: str | None = None, client=None) -> str:
    """The base image's name: `image` or $SEAMLESSFLOW_SWE_BASE_IMAGE when given (it must exist or be
    pullable), else the recipe's image, built here first if this daemon does not have it."""
    client = client or docker_client()
    prebuilt = image or os.environ.get(BASE_IMAGE_ENV)
    if prebuilt:
        return _present_or_pulled(client, prebuilt, f"the prebuilt base image ({BASE_IMAGE_ENV} or image=)")
    recipe = recipe or BaseImageRecipe()
    if _present(client, recipe.image):
        return recipe.image
    _check_can_build()
    cache = Path(os.environ.get(CACHE_ENV) or DEBOOTSTRAP_CACHE)
    with _build_lock(cache, recipe.digest()):
        if not _present(client, recipe.image):  # another process may have built it while we waited
            build_base_image(recipe, client=client, cache_dir=cache)
    return recipe.image


def build_base_image(recipe: BaseImageRecipe, *, client=None, cache_dir: Path = DEBOOTSTRAP_CACHE) -> str:
    """debootstrap the recipe into a temporary folder, trim it and `docker import` it; the image name."""
    client = client or docker_client()
    _check_can_build()
    mirror = os.environ.get(MIRROR_ENV) or DEFAULT_MIRROR
    cache_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.warning("building sandbox base image %s with debootstrap from %s (once per machine)", recipe.image, mirror)
    with tempfile.TemporaryDirectory(prefix="seamlessflow-rootfs-", dir=_scratch_dir()) as tmp:
        root, tarball = Path(tmp) / "root", Path(tmp) / "root.tar"
        try:
            _debootstrap(recipe, root, cache_dir, mirror, Path(tmp) / "debootstrap.log")
            for rel in TRIM:
                _empty_dir(root / rel)
            subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tarball), "."], check=True)
            changes = [*IMAGE_CHANGES, f"LABEL seamlessflow.recipe={recipe.digest()}"]
            repo, tag = recipe.image.rsplit(":", 1)
            client.api.import_image_from_file(str(tarball), repository=repo, tag=tag, changes=changes)
        finally:
            _unmount_under(root)  # a failed debootstrap can leave /proc mounted inside the folder
    log.warning("built %s in %.0f s", recipe.image, time.monotonic() - started)
    if not _present(client, recipe.image):
        raise ImageUnavailable(f"docker import reported no error, but {recipe.image} is not on the daemon")
    return recipe.image


def swebench_image_name(
    instance_id: str, namespace: str = "swebench", arch: str = "x86_64", tag: str = "latest"
) -> str:
    """Official SWE-bench instance image, named as SWE-bench's harness names remote images."""
    if not instance_id or "/" in instance_id or ":" in instance_id:
        raise ValueError(f"instance_id={instance_id!r} is not a SWE-bench instance id (owner__repo-number)")
    if arch not in ("x86_64", "arm64"):
        raise ValueError(f"arch={arch!r}: SWE-bench publishes x86_64 and arm64 images")
    return f"{namespace}/sweb.eval.{arch}.{instance_id.lower()}:{tag}".replace("__", "_1776_")


def ensure_swebench_image(instance_id: str, *, client=None, **naming) -> str:
    """The instance's official image, pulled first if this daemon does not have it (they are large:
    gigabytes, minutes). `naming`: `namespace`, `arch`, `tag` of `swebench_image_name`."""
    name = swebench_image_name(instance_id, **naming)
    return _present_or_pulled(client or docker_client(), name, f"the SWE-bench image of {instance_id}")


def ensure_image(name: str, what: str = "the image", *, client=None) -> str:
    """`name`, pulled first if this daemon does not have it; ImageUnavailable says what to do when it cannot be."""
    return _present_or_pulled(client or docker_client(), name, what)


def task_image(task: Instance, default_image: str | None = None, *, client=None, wheelhouse: Path | None = None) -> str:
    """The image `task` runs in (see the module docstring), made present first: pulled, or built from its
    `install` recipe with the wheels of `wheelhouse` (default $SEAMLESSFLOW_WHEELHOUSE, else `pip download`)."""

    client = client or docker_client()
    env = task.environment
    if is_official(task):
        if env.install is not None:
            raise RecipeError(
                f"instance {task.instance_id!r}: field 'install': official SWE-bench records run in "
                "their own image; name an image that has what the tests need instead"
            )
        if env.image:
            return ensure_image(env.image, f"the image of {task.instance_id}", client=client)
        return ensure_swebench_image(task.instance_id, client=client)
    if env.image:
        base = ensure_image(env.image, f"the image of {task.instance_id}", client=client)
    else:
        base = default_image or ensure_base_image(client=client)
    if env.install is None:
        return base
    try:
        return ensure_task_image(base, env.install, client=client, wheelhouse=wheelhouse)
    except RecipeError as e:
        raise RecipeError(f"instance {task.instance_id!r}: {e}") from None


def ensure_task_image(base: str, recipe: InstallRecipe, *, client=None, wheelhouse: Path | None = None) -> str:
    """`base` with `recipe` installed: the cached task image, built here (offline) the first time."""
    client = client or docker_client()
    base_id = client.images.get(_present_or_pulled(client, base, "the base of a task image")).id
    wheels = _wheels_for(recipe, base_id, client, wheelhouse)
    digest = task_image_digest(base_id, recipe, wheels)
    name = f"{TASK_REPOSITORY}:{digest}"
    if _present(client, name):
        return name
    with _build_lock(cache_dir() / "locks", f"task-{digest}"):
        if not _present(client, name):  # another builder may have finished while we waited
            build_task_image(name, base_id, recipe, wheels, client=client)
    return name


def task_image_digest(base_id: str, recipe: InstallRecipe, wheels: Path | None) -> str:
    """12 hex digits of a hash of what shapes a task image: the base image's id, the recipe, the wheel files."""
    record = {"base": base_id, "pip": sorted(recipe.pip), "commands": list(recipe.commands)}
    record |= {"wheels": wheels_digest(wheels) if wheels else [], "script_version": TASK_SCRIPT_VERSION}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:12]


def _wheels_for(recipe: InstallRecipe, base_id: str, client, wheelhouse: Path | None) -> Path | None:
    """The wheelhouse the build installs from: the one given, else the recipe's download (fetched once)."""
    if not recipe.pip:
        return None
    given = given_wheelhouse(wheelhouse)
    if given is not None:
        return given
    dest = fetched_wheels_dir(recipe, base_id)
    if not dest.is_dir():
        with _build_lock(dest.parent, dest.name):
            if not dest.is_dir():
                log.warning("downloading wheels for %s into %s", list(recipe.pip), dest)
                fetch_wheels(recipe, _target(client, base_id), dest)
    return dest


def _target(client, image: str):
    """The Python version and platform of `image`, asked of its python3 in a short sandbox."""
    from swebench_env.sandbox import Sandbox, SandboxConfig

    with Sandbox(SandboxConfig(image=image, memory_mb=256, labels={"seamlessflow.role": "probe"}), client) as sb:
        result = sb.exec(f"python3 -c {shlex.quote(PROBE)}", timeout_s=60)
    if result.exit_code != 0:
        raise RecipeError(f"install recipes need python3 in the base image; it said: {result.output.strip()[-200:]}")
    return target_from_probe(result.output)


def build_task_image(name: str, base_id: str, recipe: InstallRecipe, wheels: Path | None, *, client=None) -> str:
    """`docker build` `name` from `base_id` with the network off: the wheels copied in and installed with
    `pip install --no-index --find-links`, then the recipe's commands. RecipeError names a failing step."""
    client = client or docker_client()
    started = time.monotonic()
    log.warning("building task image %s: %s", name, recipe.to_json())
    context = build_context(name, base_id, recipe, wheels)
    output, error = [], None
    try:
        for chunk in client.api.build(
            fileobj=context,
            custom_context=True,
            tag=name,
            network_mode="none",
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
            timeout=INSTALL_TIMEOUT_S,
        ):
            output.extend(chunk.get("stream", "").splitlines())
            error = chunk.get("error") or error
    except Exception as e:  # the daemon went away, or the build timed out on the client
        raise ImageUnavailable(f"building task image {name} failed: {e}") from e
    if error is not None:
        raise _build_failure(recipe, wheels, output, error)
    log.warning("built %s in %.1f s", name, time.monotonic() - started)
    return name


def _build_failure(recipe: InstallRecipe, wheels: Path | None, output: list[str], error: str) -> Exception:
    steps = [line.split(STEP, 1)[1].strip() for line in output if STEP in line]
    last = next((line.strip() for line in reversed(output) if line.strip() and STEP not in line), error.strip())
    if steps and steps[-1] == "pip":
        return RecipeError(pip_failure("\n".join(output), f"the wheelhouse {wheels}"))
    if steps and steps[-1].startswith("command "):
        i = int(steps[-1].split()[1])
        command = f"{recipe.commands[i]!r:.80}"
        return RecipeError(f"field 'install.commands' item {i} ({command}) failed at build time: {last}")
    return ImageUnavailable(f"docker build of a task image failed: {error.strip()}")


def _present(client, name: str) -> bool:
    import docker.errors

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def _present_or_pulled(client, name: str, what: str) -> str:
    if _present(client, name):
        return name
    log.warning("pulling %s (%s)", name, what)
    try:
        client.images.pull(name)  # the SDK splits off the tag or digest (default: latest)
    except Exception as e:
        raise ImageUnavailable(
            f"{what}, {name}, is not on this Docker daemon and could not be pulled ({e}). Without a registry, "
            f"`docker load` a saved copy, or build the offline base image: unset {BASE_IMAGE_ENV} and call "
            "images.ensure_base_image()"
        ) from e
    return name


def _check_can_build() -> None:
    if shutil.which("debootstrap") is None:
        raise ImageUnavailable(
            "building the sandbox base image needs debootstrap: apt-get install -y debootstrap (or run "
            f".ci/docker-setup), or name a prebuilt image in ${BASE_IMAGE_ENV}"
        )
    if os.geteuid() != 0:
        raise ImageUnavailable(
            f"building the sandbox base image runs debootstrap, which needs root: run once as root, or name a "
            f"prebuilt image in ${BASE_IMAGE_ENV}"
        )


def _debootstrap(recipe: BaseImageRecipe, root: Path, cache_dir: Path, mirror: str, log_path: Path) -> None:
    argv = [
        "debootstrap",
        f"--variant={recipe.variant}",
        f"--include={','.join(recipe.packages)}",
        f"--cache-dir={cache_dir.resolve()}",
        recipe.suite,
        str(root),
        mirror,
    ]
    with open(log_path, "w") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise ImageUnavailable(f"debootstrap did not finish in {BUILD_TIMEOUT_S:.0f} s: {_tail(log_path)}") from e
    if done.returncode != 0:
        raise ImageUnavailable(f"debootstrap failed (exit {done.returncode}): {_tail(log_path)}")


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _empty_dir(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def _unmount_under(root: Path) -> None:
    """Unmount every mount point inside `root`, deepest first, so removing the folder stays inside it."""
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f if line.split()[1].startswith(prefix)]
    for point in sorted(points, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


def _scratch_dir() -> str:
    """A folder on disk for the ~400 MB root file system (/tmp may be a small tmpfs)."""
    return os.environ.get("TMPDIR") or ("/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir())


class _build_lock:
    """An exclusive file lock, so two processes do not build the same image at once."""

    def __init__(self, cache_dir: Path, digest: str) -> None:
        self.path = cache_dir / f"build-{digest}.lock"

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "w")  # held until __exit__
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
