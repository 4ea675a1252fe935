"""Engines owned by resource workers, as the trajectory manager's supervisor sees them.

The supervisor restarts a dead or hung engine through its `EngineHandle`; here the engine process is a
child of a resource worker (possibly on another machine), so a restart is a call to that worker. Whether
the process is alive is read from /proc when the worker runs on this machine; elsewhere the supervisor's
health probes are what notice a dead engine.
"""

from __future__ import annotations

from pathlib import Path

from reference.control.calls import WorkerGroup
from reference.control.worker import ResourceWorker


class WorkerEngine:
    def __init__(self, workers: WorkerGroup, resource: str, url: str, pid: int | None, local: bool) -> None:
        self.workers, self.resource, self.url, self.pid, self.local = workers, resource, url, pid, local
        self.restarts = 0

    def alive(self) -> bool:
        return not self.local or self.pid is None or pid_alive(self.pid)

    def restart(self) -> None:
        """Blocking (the supervisor calls it in a worker thread)."""
        self.url, self.pid = self.workers.get(self.resource, ResourceWorker.restart_engine)
        self.restarts += 1


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
