"""Files into a sandbox: a local folder (`copy_in`, or its tar made once with `folder_archive` to copy the same
folder in many times) or texts (`write_files`), unpacked by `Sandbox.put_archive` with `tar -x` inside the
container and owned by root (git refuses to work in a repository owned by another user).
"""

from __future__ import annotations

import io
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swebench_env.sandbox import Sandbox


def copy_in(sandbox: Sandbox, local_dir: str | Path | bytes, dest: str) -> None:
    """Copy the contents of `local_dir` (a git checkout, say) to `dest` in the sandbox, owned by root; or, given
    bytes, unpack that tar (as `folder_archive` writes it) there.

    Owners are reset to root because git refuses to work in a repository owned by another user."""
    if isinstance(local_dir, bytes):
        _check_dest(dest, "copy_in")
        sandbox.put_archive(dest, io.BytesIO(local_dir), make_dest=True)
        return
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise ValueError(f"copy_in: {local_dir} is not a folder")
    _put_tar(sandbox, dest, "copy_in", lambda tar: _add_as_root(tar, local_dir))


def folder_archive(local_dir: str | Path) -> bytes:
    """The tar that `copy_in(sandbox, local_dir, dest)` unpacks, as bytes (to copy the same folder in many times)."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise ValueError(f"folder_archive: {local_dir} is not a folder")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        _add_as_root(tar, local_dir)
    return buf.getvalue()


def _add_as_root(tar: tarfile.TarFile, local_dir: Path) -> None:
    tar.add(local_dir, arcname=".", filter=_as_root)


def write_files(sandbox: Sandbox, dest: str, files: Mapping[str, str], mode: int = 0o644) -> None:
    """Write `files` (name -> UTF-8 text) into the folder `dest` of the sandbox (made if absent), owned by root."""
    for name in files:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"write_files: {name!r} is not a plain file name")

    def fill(tar: tarfile.TarFile) -> None:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))

    _put_tar(sandbox, dest, "write_files", fill)


def _put_tar(sandbox: Sandbox, dest: str, caller: str, fill) -> None:
    """Make the folder `dest` in the sandbox and unpack there the tar that `fill(tar)` writes."""
    _check_dest(dest, caller)
    with tempfile.TemporaryFile() as buf:
        with tarfile.open(fileobj=buf, mode="w") as tar:
            fill(tar)
        buf.seek(0)
        sandbox.put_archive(dest, buf, make_dest=True)


def _check_dest(dest: str, caller: str) -> None:
    if not dest.startswith("/"):
        raise ValueError(f"{caller}: dest={dest!r} must be an absolute path")


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info
