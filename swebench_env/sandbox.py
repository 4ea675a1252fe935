"""Docker sandboxes for agents' shell commands: limited, isolated, timed, and always removed.

A `Sandbox` is one container started from an image with the network off (`network_mode="none"`),
memory (no swap), CPU and process-count limits, `docker-init` as pid 1 (so killed processes are
reaped), and a bounded lifetime: its main process is `sleep max_lifetime_s`, so even a container that
every clean-up missed stops by itself. `exec` runs one command with `bash -lc` in a fresh shell, as
mini-swe-agent does: no state is kept between commands but the file system. Each is a `docker exec` (about
80 ms of CPU) unless `start_shell()` has started the sandbox's command runner (`shell.py`: one exec for all
of an agent's commands, the same results); agents' workspaces start one.

Each command is wrapped so that:
- it runs under `timeout -s KILL <timeout_s>` inside the container, which kills its process group;
- when it ends, whatever it left running in its process group (`cmd &`) is killed too, so a fork bomb
  or a stray loop cannot outlive the command; start a server that must survive with `setsid`;
- stderr is merged into stdout in the order written, and the client keeps at most
  `output_limit_bytes` of it (the first and last halves, with a marker between);
- the client stops waiting when the command's main process has ended, even if something it started
  with `setsid` still holds the output open, and in any case at `timeout_s + client_grace_s`.

A command's failure is a result (`ExecResult`), not an exception; `SandboxError` means the sandbox
itself failed (the container vanished, the daemon went away). `timed_out` is inferred: exit status 137
(SIGKILL) after at least `timeout_s` on the client's clock, which cannot be earlier than the
container's. A command that the memory limit's OOM killer stops gets 137 without `timed_out`.

Disk: the writable storage is limited to `disk_mb`, so a runaway write fails alone (ENOSPC, a result) and
cannot fill the host's Docker storage. Where the daemon takes `storage_opt size` (overlay2 on xfs with
pquota, btrfs, zfs: probed once a daemon) the writable layer is capped. Elsewhere (overlay2 on ext4, the
usual case) the root file system is read-only and each of `writable_paths` is a tmpfs of `disk_mb`, filled
at start with what the image holds there; tmpfs pages are charged to the container's memory cgroup, so
its memory limit is `memory_mb + disk_mb`. Files are copied in with `tar -x` inside the container, since
the daemon's own copy (`put_archive`) writes beneath tmpfs mounts, where the container cannot see them.

Clean-up: `close()` (or leaving the `with` block) removes the container. At interpreter exit, and on
SIGTERM or SIGHUP where the process had the default handler (it is replaced by one that raises
SystemExit), the sandboxes still open are removed. A process killed outright leaves its containers
for the reaper (`reaper.py`), which the first `start()` of the next process runs.

A command's output stream is read by `exec_stream.py`; files are copied in by `sandbox_files.py` (`copy_in`,
`folder_archive`, `write_files`).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import signal
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from swebench_env.docker_util import DockerUnavailable, docker_client
from swebench_env.exec_stream import Output, close_socket, exit_status, pump, send
from swebench_env.reaper import LABEL, Owner, reap_stale_sandboxes

__all__ = [
    "LABEL",
    "DockerUnavailable",
    "ExecResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "reap_stale_sandboxes",
]

log = logging.getLogger(__name__)

# $0 = timeout in seconds, $1 = the command. `timeout` makes itself a process-group leader, so its pid
# is the group that holds everything the command started.
WRAPPER = """timeout -s KILL "$0" bash -lc "$1" 2>&1 &
t=$!
wait "$t"; rc=$?
kill -s KILL -- "-$t" 2>/dev/null
exit "$rc"
"""
# Where a sandbox with a read-only root may write, and each place's permissions.
WRITABLE_PATHS = ("/testbed", "/tmp", "/var/tmp", "/root", "/home")
_TMPFS_MODE = {"/tmp": "1777", "/var/tmp": "1777", "/root": "700"}
CACHED_CONTENT_BYTES = 1 << 20  # an image's content at the writable places, kept in memory up to this size
SIGKILL_STATUS = 128 + signal.SIGKILL


class SandboxError(RuntimeError):
    """The sandbox itself failed (not a command in it): creation, a vanished container, the daemon."""


@dataclass(frozen=True)
class SandboxConfig:
    image: str  # e.g. images.ensure_base_image() or images.ensure_swebench_image(instance_id)
    memory_mb: int = 2048  # RAM limit, swap included (no swap); the OOM killer stops the largest process
    cpus: float = 1.0  # CPU quota in cores
    pids_limit: int = 512  # processes and threads in the container
    network: bool = False  # False: no network interface but loopback
    workdir: str = "/"  # where commands run unless `exec(workdir=...)` says otherwise
    command_timeout_s: float = 300.0  # for `exec` calls that give no timeout
    client_grace_s: float = 10.0  # the client gives up on a command at timeout_s + this
    output_limit_bytes: int = 256 * 1024  # output kept per command (first and last halves)
    max_lifetime_s: float = 6 * 3600.0  # the container stops by itself after this long
    disk_mb: int | None = 1024  # writable storage (see "Disk" above); None: none, a writable root as plain Docker
    writable_paths: tuple[str, ...] = WRITABLE_PATHS  # where commands may write when the root is read-only
    env: Mapping[str, str] = field(default_factory=dict)  # environment of every command
    labels: Mapping[str, str] = field(default_factory=dict)  # extra container labels
    name_prefix: str = "seamlessflow-sbx"

    def __post_init__(self) -> None:
        checks = {
            "image": bool(self.image),
            "memory_mb": self.memory_mb >= 16,
            "cpus": self.cpus > 0,
            "pids_limit": self.pids_limit >= 8,
            "command_timeout_s": self.command_timeout_s > 0,
            "client_grace_s": self.client_grace_s > 0,
            "output_limit_bytes": self.output_limit_bytes >= 64,
            "max_lifetime_s": self.max_lifetime_s >= 1,
            "workdir": self.workdir.startswith("/"),
            "disk_mb": self.disk_mb is None or self.disk_mb >= 16,
            "writable_paths": all(p.startswith("/") and p.rstrip("/") for p in self.writable_paths),
        }
        allowed = "memory_mb >= 16, cpus > 0, pids_limit >= 8, timeouts > 0, output >= 64 B, absolute workdir, " + (
            "disk_mb >= 16 or None, writable_paths absolute and not /"
        )
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"SandboxConfig.{name}={getattr(self, name)!r} is not allowed ({allowed})")


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # the command's status; 137 when SIGKILLed; -1 when the client gave up waiting
    output: str  # stdout and stderr merged, decoded as UTF-8 (errors replaced), possibly truncated
    timed_out: bool
    truncated: bool = False  # output exceeded the limit; the middle was left out
    duration_s: float = 0.0  # on the client's clock, from exec creation to the exit status


class Sandbox:
    """One container; `with Sandbox(config) as sb: sb.exec("ls")`. Safe to use from several threads."""

    def __init__(self, config: SandboxConfig, client=None) -> None:
        self.config = config
        self._client = client
        self._container = None
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process that may close it (a forked child's exit hooks must not)
        self.name = f"{config.name_prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"
        self.disk_limit: str | None = None  # once started: "storage_opt", "tmpfs" or None (see "Disk" above)
        self._shell = None  # the command runner (`start_shell`), while it lives

    def __enter__(self) -> Sandbox:
        return self if self._container is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def id(self) -> str:
        return self._require().id

    def start(self) -> Sandbox:
        """Create and start the container (after reaping dead processes' sandboxes, once a process)."""
        with self._lock:
            if self._container is not None:
                raise SandboxError(f"sandbox {self.name} is already started")
            self._client = self._client or docker_client()
            _on_first_start(self._client)
            if self.config.disk_mb is not None:
                self.disk_limit = "storage_opt" if _storage_opt_supported(self._client, self.config) else "tmpfs"
            self._container = self._create()
            with _live_lock:
                _LIVE.add(self)
        try:
            self._container.start()
            if self.disk_limit == "tmpfs":
                self._copy_up()
        except Exception as e:
            self.close()
            raise SandboxError(f"sandbox {self.name} did not start from image {self.config.image!r}: {e}") from e
        return self

    def _copy_up(self) -> None:
        """Fill the writable places (empty tmpfs mounts) with what the image holds there, as a volume would be.
        What a small image holds there is read once a process (the image is immutable)."""
        key = (self._container.attrs.get("Image", self.config.image), self.config.writable_paths)
        with tempfile.TemporaryFile() as buf:
            if key in _image_content:
                buf.write(_image_content[key])
            else:
                with tarfile.open(fileobj=buf, mode="w") as tar:
                    found = sum(_add_image_dir(tar, self._container, p) for p in self.config.writable_paths)
                if buf.tell() <= CACHED_CONTENT_BYTES:
                    buf.seek(0)
                    _image_content[key] = buf.read() if found else b""
            if buf.tell():
                buf.seek(0)
                self.put_archive("/", buf)

    def _create(self):
        c = self.config
        storage, memory_mb = _storage_options(c, self.disk_limit)
        try:
            return self._client.containers.create(
                c.image,
                entrypoint=["sleep", str(math.ceil(c.max_lifetime_s))],
                name=self.name,
                labels={**c.labels, **Owner.current().labels()},
                init=True,
                network_mode="bridge" if c.network else "none",
                mem_limit=f"{memory_mb}m",
                memswap_limit=f"{memory_mb}m",
                **storage,
                nano_cpus=int(c.cpus * 1e9),
                pids_limit=c.pids_limit,
                security_opt=["no-new-privileges"],
                cap_drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT"],
                working_dir=c.workdir,
                environment=dict(c.env),
            )
        except Exception as e:
            raise SandboxError(f"could not create sandbox {self.name} from image {c.image!r}: {e}") from e

    def start_shell(self) -> bool:
        """Start the sandbox's command runner (`swebench_env.shell`): from now on `exec` runs commands through
        it, one `docker exec` for all of them instead of one each. False where it cannot start (no `python3` in
        the image): `exec` goes on with `docker exec`. For a sandbox that runs many commands (an agent's)."""
        from swebench_env.shell import Shell, ShellError

        container = self._require()
        with self._lock:
            if self._shell is not None and self._shell.alive:
                return True
            try:
                self._shell = Shell(self._client.api, container.id, WRAPPER, self.config.env, self.config.workdir)
            except ShellError as e:
                log.info("sandbox %s: %s; commands go through docker exec", self.name, e)
                self._shell = None
                return False
        return True

    def exec(
        self, cmd: str, timeout_s: float | None = None, workdir: str | None = None, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run `cmd` with `bash -lc`; returns when it ends, is killed at `timeout_s`, or the client gives up."""
        timeout_s = self.config.command_timeout_s if timeout_s is None else timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be positive")
        container = self._require()
        shell = self._shell
        if shell is not None and shell.alive and shell.lock.acquire(blocking=False):
            try:
                return self._exec_in(shell, cmd, timeout_s, workdir, env)
            finally:
                shell.lock.release()
        api = self._client.api
        start = time.monotonic()
        try:
            exec_id = api.exec_create(
                container.id,
                ["sh", "-c", WRAPPER, f"{timeout_s:.3f}", cmd],
                workdir=workdir or self.config.workdir,
                environment={**self.config.env, **(env or {})},
            )["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except Exception as e:
            raise SandboxError(f"sandbox {self.name}: could not run a command: {e}") from e
        out = Output(self.config.output_limit_bytes)
        try:
            ended = pump(
                sock,
                out,
                lambda: not api.exec_inspect(exec_id)["Running"],
                start + timeout_s,
                self.config.client_grace_s,
            )
            status = exit_status(api, exec_id) if ended else None
        except Exception as e:
            self._require()  # closed under the command (its status went with the container): "not running"
            raise SandboxError(f"sandbox {self.name}: lost a command's stream or status: {e}") from e
        finally:
            close_socket(sock)
        duration_s = time.monotonic() - start
        timed_out = status is None or (status == SIGKILL_STATUS and duration_s >= timeout_s)
        exit_code = -1 if status is None else status
        return ExecResult(exit_code, out.text(), timed_out, out.dropped > 0, duration_s)

    def _exec_in(self, shell, cmd: str, timeout_s: float, workdir: str | None, env) -> ExecResult:
        c = self.config
        start = time.monotonic()
        answer = shell.run(
            cmd, timeout_s, workdir or c.workdir, {**c.env, **(env or {})}, c.output_limit_bytes, c.client_grace_s
        )
        if answer.status is None:
            self._require()  # a closed sandbox or a vanished container is a SandboxError, as for `docker exec`
        duration_s = time.monotonic() - start
        out = Output(c.output_limit_bytes)
        out.head, out.tail, out.dropped = bytearray(answer.head), bytearray(answer.tail), answer.dropped
        status = answer.status
        timed_out = (status is None and not answer.died) or (status == SIGKILL_STATUS and duration_s >= timeout_s)
        return ExecResult(-1 if status is None else status, out.text(), timed_out, out.dropped > 0, duration_s)

    def put_archive(self, dest: str, tar_stream, make_dest: bool = False) -> None:
        """Unpack a tar (a binary file object) at `dest`, an existing folder (made first, with its parents, if
        `make_dest`), with `tar -x` in the container: the daemon's own copy cannot write into tmpfs mounts, and
        files written in the container count against its limits. A full disk or a read-only `dest` raises
        SandboxError with tar's (or mkdir's) complaint. One `docker exec` either way."""
        api, container = self._client.api, self._require()
        untar = ["tar", "-x", "-C", dest, "-f", "-"]
        if make_dest:
            untar = ["sh", "-c", 'mkdir -p -- "$0" && exec tar -x -C "$0" -f -', dest]
        try:
            exec_id = api.exec_create(container.id, untar, stdin=True)["Id"]
            sock = api.exec_start(exec_id, socket=True)
        except Exception as e:
            raise SandboxError(f"sandbox {self.name}: could not copy files into {dest}: {e}") from e
        out = Output(4096)
        try:
            send(sock, tar_stream, out)
            status = exit_status(api, exec_id)
        except Exception as e:
            raise SandboxError(f"sandbox {self.name}: lost the copy into {dest}: {e}") from e
        finally:
            close_socket(sock)
        if status != 0:
            raise SandboxError(f"sandbox {self.name}: copying files into {dest} failed: {out.text().strip()}")

    def close(self) -> None:
        """Remove the container (idempotent; never raises for a container that is already gone)."""
        with self._lock:
            container, self._container = self._container, None
            shell, self._shell = self._shell, None
        if shell is not None:
            shell.close()
        with _live_lock:
            _LIVE.discard(self)
        if container is None:
            return
        try:
            container.remove(force=True, v=True)
        except Exception as e:
            if getattr(getattr(e, "response", None), "status_code", None) not in (404, 409):
                log.warning(
                    "sandbox %s: removal failed (%s); the reaper removes it once this process has ended", self.name, e
                )

    def _require(self):
        container = self._container
        if container is None:
            raise SandboxError(f"sandbox {self.name} is not running (not started, or closed)")
        return container


def _add_image_dir(tar: tarfile.TarFile, container, path: str) -> int:
    """Add to `tar` what the image holds at `path` (the daemon's view: not the container's tmpfs mounts); the
    number of entries below the folder itself (0 when the image has nothing there)."""
    try:
        stream, _ = container.get_archive(path)
    except Exception as e:
        if getattr(getattr(e, "response", None), "status_code", None) == 404:
            return 0
        raise
    with tempfile.TemporaryFile() as part:
        for chunk in stream:
            part.write(chunk)
        part.seek(0)
        parent = path.rstrip("/").rsplit("/", 1)[0].lstrip("/")
        members = 0
        with tarfile.open(fileobj=part, mode="r|") as image_tar:
            for info in image_tar:
                members += "/" in info.name.rstrip("/")
                info.name = f"{parent}/{info.name}" if parent else info.name
                tar.addfile(info, image_tar.extractfile(info) if info.isfile() else None)
    return members


def _storage_options(config: SandboxConfig, limit: str | None) -> tuple[dict, int]:
    """(container-create arguments, memory limit in MB) for a disk limit: tmpfs pages are charged to the
    container's memory, so with tmpfs the memory limit grows by `disk_mb`."""
    if limit is None:
        return {}, config.memory_mb
    if limit == "storage_opt":
        return {"storage_opt": {"size": f"{config.disk_mb}m"}}, config.memory_mb
    tmpfs = {p: f"size={config.disk_mb}m,mode={_TMPFS_MODE.get(p, '755')},exec" for p in config.writable_paths}
    return {"read_only": True, "tmpfs": tmpfs}, config.memory_mb + config.disk_mb


_image_content: dict[tuple[str, tuple[str, ...]], bytes] = {}  # (image id, writable paths) -> tar ("": nothing)
_storage_opt: dict[str, bool] = {}  # daemon -> whether it limits a container's writable layer (`--storage-opt size`)
_storage_opt_lock = threading.Lock()


def _storage_opt_supported(client, config: SandboxConfig) -> bool:
    """Whether the daemon takes `storage_opt size` (overlay2 on xfs with pquota, btrfs, zfs...): asked once a
    daemon, by creating (and removing) a container that asks for it."""
    key = str(getattr(client.api, "base_url", id(client)))
    with _storage_opt_lock:
        if key not in _storage_opt:
            answer = _probe_storage_opt(client, config)
            if answer is None:
                return False  # the probe failed for another reason (the image is missing): ask again next time
            _storage_opt[key] = answer
        return _storage_opt[key]


def _probe_storage_opt(client, config: SandboxConfig) -> bool | None:
    name = f"{config.name_prefix}-probe-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    try:
        probe = client.containers.create(
            config.image,
            entrypoint=["true"],
            name=name,
            network_mode="none",
            labels=Owner.current().labels(),
            storage_opt={"size": "64m"},
        )
    except Exception as e:  # "--storage-opt is supported only for overlay over xfs with 'pquota' mount option"
        if "storage" not in str(e).lower():
            return None
        log.info("the Docker daemon does not limit a container's storage (%s); sandboxes use tmpfs", e)
        return False
    probe.remove(force=True, v=True)
    return True


# Sandboxes not yet closed, for the exit hooks.
_LIVE: set[Sandbox] = set()
_live_lock = threading.Lock()
_hooks_lock = threading.Lock()
_hooked = {"pid": 0, "signals": False}  # the process that set the hooks up; a forked child does it again


def _on_first_start(client) -> None:
    """Once a process: exit hooks, signal handlers where the defaults are in place, the reaper."""
    with _hooks_lock:
        if _hooked["pid"] != os.getpid():
            _hooked["pid"] = os.getpid()
            atexit.register(_close_all, os.getpid())
            try:
                reap_stale_sandboxes(client)
            except Exception as e:  # never stop a run over another run's leftovers
                log.warning("could not reap stale sandboxes: %s", e)
        if not _hooked["signals"] and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) is signal.SIG_DFL:
                    signal.signal(sig, _exit_on_signal)
            _hooked["signals"] = True


def _exit_on_signal(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once (the reaper cleans up)
    raise SystemExit(128 + signum)


def _close_all(pid: int) -> None:
    if os.getpid() == pid:  # not a forked child that inherited this hook
        close_open_sandboxes()


def close_open_sandboxes() -> int:
    """Remove every sandbox this process has open (a stopped run: their commands fail at once); how many."""
    with _live_lock:
        mine = [s for s in _LIVE if s._pid == os.getpid()]
    for sandbox in mine:
        sandbox.close()
    return len(mine)
