"""The CPU a runtime run's processes use, by role, read from /proc while it runs (`CpuSampler`): the driver (with
the trajectory and rollout managers), the engines, Ray's workers (the trainers), everything else the run
started, and the Docker daemon with the sandboxes' containers (`docker_cpu_s`). `experiments.validate` samples
every runtime run with it and prints `cpu_table`; the cores each role kept busy while engines generate, and while
only trainers work, come from the run's timeline.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

DOCKER_COMMANDS = ("dockerd", "containerd", "runc", "docker-init", "docker-proxy")


def docker_processes(processes: dict[int, tuple[int, float, str]]) -> dict[int, float]:
    """Of `processes` (pid -> (parent, CPU-seconds, command name)), the Docker daemon's (dockerd, containerd and
    its shims, runc) and everything that descends from a shim (the containers' processes): pid -> CPU-seconds."""
    out = {pid: cpu for pid, (_, cpu, comm) in processes.items() if comm.startswith(DOCKER_COMMANDS)}
    shims = {pid for pid, (_, _, comm) in processes.items() if comm.startswith("containerd-shim")}
    for pid in sorted(processes):  # parents have lower pids except after a wrap: walk up instead
        parent, seen = processes[pid][0], 0
        while parent in processes and parent not in shims and seen < 64:
            parent, seen = processes[parent][0], seen + 1
        if parent in shims:
            out[pid] = processes[pid][1]
    return out


def docker_cpu_s() -> float:
    """CPU-seconds the Docker daemon's processes and the containers' have used so far (`docker_processes`)."""
    tick, processes = os.sysconf("SC_CLK_TCK"), {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            processes[int(entry)] = (
                int(fields[1]),
                (int(fields[11]) + int(fields[12])) / tick,
                stat[stat.index("(") + 1 : stat.rindex(")")],
            )
    return sum(docker_processes(processes).values())


class CpuSampler:
    """CPU-seconds of a run's processes by role, read from /proc every `every_s` while it runs (the
    reads cost about 1% of a core): the run's own process (the driver, with the trajectory and rollout
    managers), its engine processes, Ray's workers (the resources' trainers) and everything else it
    started, and the Docker daemon's processes with the sandboxes' containers (`docker`: what the daemon used
    before the run's first read is left out). A process that ends between two reads loses what it used since
    the last."""

    ROLES = ("driver", "engines", "ray workers", "other", "docker")

    def __init__(self, root: int, every_s: float = 0.25) -> None:
        self.root, self.every_s = root, every_s
        self._seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU-seconds at the last read)
        self._base: dict[int, float] = {}  # docker processes already running at the first read: their CPU then
        self._series: list[tuple[float, dict[str, float]]] = []  # (Unix time, CPU-seconds by role) of each read
        self._tick = os.sysconf("SC_CLK_TCK")
        self._wall_s = 0.0

    def follow(self, proc: subprocess.Popen) -> str:
        """Read until `proc` ends; its standard error."""
        import threading

        err: list[str] = []
        reader = threading.Thread(target=lambda: err.append(proc.stderr.read() if proc.stderr else ""), daemon=True)
        reader.start()
        started = time.perf_counter()
        while proc.poll() is None:
            self._read()
            time.sleep(self.every_s)
        self._wall_s = time.perf_counter() - started
        reader.join()
        return "".join(err)

    def _read(self) -> None:
        first = not self._series
        docker: dict[int, tuple[int, float, str]] = {}  # other processes: pid -> (parent, CPU-seconds, name)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu = (int(fields[11]) + int(fields[12])) / self._tick
            if pid != self.root and pid not in self._seen and not self._descends(int(fields[1])):
                docker[pid] = (int(fields[1]), cpu, stat[stat.index("(") + 1 : stat.rindex(")")])
                continue
            role = self._role(pid, stat, cmdline)
            if pid in self._seen and role == "other":  # an ending process's cmdline reads empty: keep its role
                role = self._seen[pid][0]
            self._seen[pid] = (role, cpu - self._base.get(pid, 0.0))  # (a docker process's CPU before the run out)
        for pid, cpu in docker_processes(docker).items():
            if first:
                self._base[pid] = cpu
            self._seen[pid] = ("docker", cpu - self._base.get(pid, 0.0))
        self._series.append((time.time(), self._by_role()))

    def _by_role(self) -> dict[str, float]:
        by_role = dict.fromkeys(self.ROLES, 0.0)
        for role, cpu in self._seen.values():
            by_role[role] += cpu
        return by_role

    def _descends(self, parent: int) -> bool:
        return parent == self.root or parent in self._seen

    def _role(self, pid: int, stat: str, cmdline: str) -> str:
        if pid == self.root:
            return "driver"
        if " -m reference engine" in cmdline:
            return "engines"
        if stat[stat.index("(") + 1 :].startswith("ray::") or cmdline.startswith("ray::"):
            return "ray workers"
        return "other"

    def result(self) -> dict:
        by_role = self._by_role()
        return {"wall_s": round(self._wall_s, 2), "cpu_s": {k: round(v, 2) for k, v in by_role.items()}}

    def while_generating(self, timeline: Path) -> dict | None:
        """Cores each role kept busy, on average, over the reads whose midpoint falls while some resource
        is in a rollout phase of the run's timeline, and the seconds those reads cover; None when the
        timeline does not give its clock's zero as a Unix time (`clock_zero_epoch_s`)."""
        from core.tags import Phase

        return self.while_phase(timeline, Phase.ROLLOUT, exclusive=False)

    def while_training_only(self, timeline: Path) -> dict | None:
        """As `while_generating`, over the reads while some resource trains and none generates: what takes
        cores from the trainers when no engine has work."""
        from core.tags import Phase

        return self.while_phase(timeline, Phase.TRAIN, exclusive=True)

    def while_phase(self, timeline: Path, phase, exclusive: bool) -> dict | None:
        """Cores each role kept busy over the reads whose midpoint falls in a `phase` interval of some
        resource (with `exclusive`, and in no other resource's rollout or train interval of another phase)."""
        from core.tags import Phase
        from core.timeline import Timeline

        if not timeline.is_file():
            return None
        run = Timeline.load(timeline)
        zero = run.meta.get("clock_zero_epoch_s")
        if zero is None or len(self._series) < 2:
            return None
        spans = [(i.start_s + zero, i.end_s + zero) for i in run.intervals if i.phase is phase]
        others = [
            (i.start_s + zero, i.end_s + zero)
            for i in run.intervals
            if exclusive and i.phase is not phase and i.phase in (Phase.ROLLOUT, Phase.TRAIN)
        ]
        seconds, cpu = 0.0, dict.fromkeys(self.ROLES, 0.0)
        for (t0, c0), (t1, c1) in zip(self._series, self._series[1:], strict=False):
            middle = (t0 + t1) / 2
            inside = any(start <= middle < end for start, end in spans)
            if inside and not any(start <= middle < end for start, end in others):
                seconds += t1 - t0
                for role in self.ROLES:
                    cpu[role] += c1[role] - c0[role]
        cores = {role: round(cpu[role] / seconds, 2) if seconds else None for role in self.ROLES}
        return {"seconds": round(seconds, 2), "cores": cores}


def cpu_table(cpu: dict[str, dict], cores: int) -> str:
    """CPU-seconds of each runtime run's processes by role, and the share of the machine's cores used."""
    roles = CpuSampler.ROLES
    lines = [
        f"runtime CPU-seconds by process ({cores} cores): {'policy':<14} "
        + " ".join(f"{r:>12}" for r in roles)
        + f" {'wall s':>8} {'cores used':>10}"
    ]
    for policy, row in cpu.items():
        total = sum(row["cpu_s"].values())
        used = total / row["wall_s"] if row["wall_s"] else math.nan
        lines.append(
            f"{'':<37} {policy:<14} "
            + " ".join(f"{row['cpu_s'][r]:12.1f}" for r in roles)
            + f" {row['wall_s']:8.1f} {used:10.2f}"
        )
    for key, title in (
        ("while_generating", "cores busy while engines generate:      "),
        ("while_training_only", "cores busy while only trainers work:    "),
    ):
        spans = {p: row[key] for p, row in cpu.items() if row.get(key) and row[key]["seconds"]}
        if not spans:
            continue
        lines.append(f"{title}  {'policy':<14} " + " ".join(f"{r:>12}" for r in roles) + f" {'seconds':>8} {'all':>10}")
        for policy, row in spans.items():
            cores = row["cores"]
            total = sum(v for v in cores.values() if v is not None)
            lines.append(
                f"{'':<41} {policy:<14} "
                + " ".join(f"{(cores[r] or 0):12.2f}" for r in roles)
                + f" {row['seconds']:8.1f} {total:10.2f}"
            )
    return "\n".join(lines)
