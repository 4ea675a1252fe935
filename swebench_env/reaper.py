"""Who owns a sandbox container, and removing the ones whose owner is gone.

Every sandbox container carries labels naming its owner: host name, boot id, process id and the
process's start time (so a recycled pid is not mistaken for the owner). A process that ends normally
removes its sandboxes itself (`Sandbox.close`, a `with` block, or the exit hooks of `sandbox.py`); one
that is SIGKILLed or crashes cannot, so `reap_stale_sandboxes` removes containers with our label whose
owner process is no longer alive. `Sandbox.start` runs it once per process, so the next run on a
machine cleans up after a crashed one. Containers owned by another host (a shared remote daemon) are
left alone: their owner cannot be checked from here, unless `older_than_s` says they are too old.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from functools import cache

from swebench_env.docker_util import docker_client

log = logging.getLogger(__name__)

LABEL = "seamlessflow.sandbox"  # "1" on every sandbox container
OWNER_HOST = "seamlessflow.owner_host"
OWNER_BOOT = "seamlessflow.owner_boot"
OWNER_PID = "seamlessflow.owner_pid"
OWNER_START = "seamlessflow.owner_start"  # the owner's start time in clock ticks after boot ("" where unknown)
CREATED = "seamlessflow.created"  # unix seconds


@dataclass(frozen=True)
class Owner:
    host: str
    boot_id: str
    pid: int
    start: str

    @classmethod
    def current(cls) -> Owner:
        return cls(socket.gethostname(), _boot_id(), os.getpid(), process_start(os.getpid()))

    def labels(self) -> dict[str, str]:
        return {
            LABEL: "1",
            OWNER_HOST: self.host,
            OWNER_BOOT: self.boot_id,
            OWNER_PID: str(self.pid),
            OWNER_START: self.start,
            CREATED: f"{time.time():.3f}",
        }

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> Owner | None:
        try:
            return cls(labels[OWNER_HOST], labels[OWNER_BOOT], int(labels[OWNER_PID]), labels[OWNER_START])
        except (KeyError, ValueError):
            return None


def is_stale(labels: dict[str, str], here: Owner, now_s: float, older_than_s: float | None = None) -> bool:
    """Whether the container with `labels` belongs to a process that is gone (pure but for /proc)."""
    if older_than_s is not None and now_s - float(labels.get(CREATED, now_s)) > older_than_s:
        return True
    owner = Owner.from_labels(labels)
    if owner is None or owner.host != here.host:
        return False  # not ours to judge
    if owner.boot_id != here.boot_id:
        return True  # the machine rebooted since: every process of that boot is gone
    return not process_alive(owner.pid, owner.start)


def reap_stale_sandboxes(client=None, older_than_s: float | None = None) -> list[str]:
    """Remove our sandbox containers whose owner process is gone; the names removed."""
    client = client or docker_client()
    here, now_s = Owner.current(), time.time()
    removed = []
    for container in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}, ignore_removed=True):
        if not is_stale(container.labels, here, now_s, older_than_s):
            continue
        try:
            container.remove(force=True, v=True)
        except Exception as e:  # another reaper, or the owner's own close, got there first
            if getattr(getattr(e, "response", None), "status_code", None) not in (404, 409):
                raise
        removed.append(container.name)
    if removed:
        log.info("removed %d sandbox container(s) left by dead processes: %s", len(removed), ", ".join(removed))
    return removed


def process_start(pid: int) -> str:
    """The process's start time in clock ticks after boot, from /proc ("" where /proc has no answer)."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else ""


def process_alive(pid: int, start: str) -> bool:
    """Whether process `pid` runs and is the one that started at `start` (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    fields = _stat(pid)
    if not fields:
        return True  # no /proc here: the pid exists, and that is all we can tell
    return fields[0] not in ("Z", "X") and (not start or fields[19] == start)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state first), or [] where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


@cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
