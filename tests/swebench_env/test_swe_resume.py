"""Fault test: the process that holds the trajectory manager is SIGKILLed mid-run; `--resume DIR` finishes the run.

A small SWE run (`python -m reference train` in a process and session of its own: 2 train tasks and 1 held-out
task, 3 steps of 2 tasks x 2 episodes, 2 turns an episode, a checkpoint every step, no warm start) is killed
once a checkpoint is written, a finished group that no step consumed waits (one the killed run cannot consume
before it dies) and, with Docker, sandboxes of the run are live. Then `python -m reference train --resume DIR`.
What it must show:

- the resumed run trains every step after the checkpoint and exits 0 (killed just after the trainer wrote the
  checkpoint, before that version of the weights was published, it publishes it: `layout.resumed_weights`);
- each finished group the killed run left untrained (never consumed, or consumed by a step after the checkpoint,
  which the resume releases: `reference.control.layout.resumed`) is adopted and trained, no group is trained
  twice, what the steps before the checkpoint consumed stands, and the adopted episodes' timings are reported
  with the step that trains them;
- the store's consistency check finds 0 token mismatches, and tokens of version 0 and of the checkpoint's version
  re-score under those weights (the resumed engines serve the checkpoint);
- the killed run's Ray workers and engines end with it (the engines watch their stdin); with Docker, its
  sandboxes are removed by the resumed run and no container of either run is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import pytest

from reference.consistency import check_store, scoring_temperature
from reference.manager.store import TrajectoryStore
from reference.model import load_checkpoint
from reference.rollout.groups import untrained_groups
from reference.trainer.handoff import version_dir
from swebench_env.docker_util import docker_available
from swebench_env.reaper import LABEL, OWNER_PID
from swebench_env.suite import load_suite
from swebench_env.tasks import dump_tasks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS, PROMPTS, GROUP = 5, 2, 2  # steps enough to catch a fast run with a finished group waiting
SMALL = [f"rollout.prompts_per_step={PROMPTS}", f"rollout.group_size={GROUP}", "task.options.max_turns=2",
         "task.options.max_tokens=64", "task.options.overlong=train", "warm_start.steps=0", "run.eval_every_steps=0",
         "run.checkpoint_every_steps=1", "run.time_limit_s=1200"]  # fmt: skip
RUN_TIMEOUT_S = 1200  # each process, on a loaded 2-core machine


def _wait_for(condition, timeout_s: float, what: str, poll_s: float = 0.05):
    """condition()'s first truthy value, polled until a deadline (AssertionError naming `what` after it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Run:
    """A `python -m reference train` process in a session of its own, its output in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("ab") as f:
            # As from a terminal: a shell's background job (a CI runner's) would pass SIGINT on ignored, and a
            # process started with SIGINT ignored never sees Ctrl-C.
            self.process = subprocess.Popen([sys.executable, "-m", "reference", "train", *args], cwd=REPO, stdout=f,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_default_sigint)  # fmt: skip
        self.pid = self.process.pid

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def alive(self) -> bool:
        if self.process.poll() is None:
            return True
        raise AssertionError(f"the run ended (exit {self.process.returncode}) before it was killed:\n{self.tail()}")


def _processes(match) -> list[int]:
    """Live processes (zombies left out) for which `match(sid, cmdline)` holds, by /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if stat[0] not in ("Z", "X") and match(int(stat[3]), cmdline):
            found.append(int(entry.name))
    return found


def _end_leftovers(runs: list[Run], out: Path, client) -> None:
    """Kill, by pid, whatever the runs left: their sessions' processes (Ray's agents outlive a SIGKILLed driver)
    and any process working on `out` (engines have sessions of their own); remove the runs' containers."""
    for run in runs:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait(timeout=30)
    sessions = {run.pid for run in runs}
    for pid in _processes(lambda sid, cmd: sid in sessions or str(out) in cmd):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if client is not None:  # a run that failed before it reaped what the killed one left
        for container in _containers(client, *sessions):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


def _containers(client, *pids: int) -> list:
    """The sandbox containers these processes own (on this machine), removed ones left out."""
    found = []
    for pid in pids:
        labels = [f"{LABEL}=1", f"{OWNER_PID}={pid}"]
        found += client.containers.list(all=True, filters={"label": labels}, ignore_removed=True)
    return found


def _checkpoint(out: Path) -> int | None:
    found = sorted((out / "checkpoints").glob("step-*"))
    return int(found[-1].name.removeprefix("step-")) if found else None


def _ready_to_kill(run: Run, out: Path, store: TrajectoryStore, client) -> int | None:
    """The last checkpoint, once one is written, a finished group that no step consumed waits, no step consumed
    groups for the run's last step and, with Docker, a sandbox of the run is live; else None. Called while the
    run's driver is stopped (SIGSTOP), so that nothing it does can change the answer before the kill.

    A group consumed by the step in flight is not enough: the trainer worker finishes that step, checkpoint
    included, after the driver is killed, so the group ends up behind the checkpoint; for the same reason the step
    in flight must not be the run's last, or the resumed run finds every step trained. A stopped driver consumes
    nothing more, so an unconsumed group stays unconsumed through the kill."""
    step = _checkpoint(out)
    if step is None:
        return None
    consumed = store.consumed()
    step = _checkpoint(out)  # read after `consumed`: a step the trainer finished meanwhile is not in flight
    assert step < STEPS, f"the run trained all {STEPS} steps before it could be killed:\n{run.tail()}"
    if max(consumed.values(), default=-1) + 1 >= STEPS or not untrained_groups(store):
        return None
    if client is not None and not _containers(client, run.pid):
        return None
    return step


def _kill(run: Run, out: Path, client) -> int:
    """SIGKILL the run once it is ready (checked with its driver stopped, killed before it runs again); the
    checkpoint it leaves, once its workers are gone (a trainer worker finishes the step it is in, checkpoint
    included, before Ray ends it)."""
    _wait_for(lambda: run.alive() and _checkpoint(out) is not None, RUN_TIMEOUT_S, "a first checkpoint")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with TrajectoryStore(out / "trajectories.sqlite") as store:  # opened while the driver runs: no lock waits
        while True:
            run.alive()
            run.process.send_signal(signal.SIGSTOP)
            ready = None
            try:
                ready = _ready_to_kill(run, out, store, client)
            finally:
                if not ready:
                    run.process.send_signal(signal.SIGCONT)
            if ready:
                break
            assert time.monotonic() < deadline, f"timed out waiting for a waiting group to kill on:\n{run.tail()}"
            time.sleep(0.05)
    run.process.send_signal(signal.SIGKILL)
    run.process.wait(timeout=60)

    def working(sid: int, cmd: str) -> bool:  # its Ray workers, and their engines (sessions of their own)
        return (sid == run.pid and "ResourceWorker" in cmd) or ("reference engine" in cmd and str(out) in cmd)

    _wait_for(lambda: not _processes(working), 120, "the killed run's workers and engines to end", poll_s=0.2)
    return _checkpoint(out)


def _step_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == "step"]


def _task_files(tmp_path: Path) -> list[str]:
    train = dump_tasks(load_suite("train")[:2], tmp_path / "tasks" / "train.jsonl")
    held_out = dump_tasks(load_suite("held_out")[:1], tmp_path / "tasks" / "held_out.jsonl")
    return [f"task.options.train_tasks={train}", f"task.options.held_out_tasks={held_out}"]


def _args(out: Path, sandbox: str, tmp_path: Path) -> list[str]:
    args = ["--config", str(REPO / "reference/configs/swe.yaml"), "--out", str(out), "--steps", str(STEPS), "--quiet"]
    for item in [*SMALL, f"task.options.sandbox={sandbox}", *_task_files(tmp_path)]:
        args += ["--set", item]
    return args


def _consistent(out: Path, version: int):
    """The store checked at the temperature of the log-probs the run's engines recorded (`scoring_temperature`:
    the SWE recipe's engine.logprobs_mode raw records the temperature-1 model's, processed the sampled one's)."""
    model, tokenizer = load_checkpoint(version_dir(out / "weights", version))
    temperature = scoring_temperature(None, out)
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        return check_store(store, model, tokenizer, version=version, temperature=temperature)


@dataclass(frozen=True)
class Killed:
    """What the killed run left, and what the resumed one did."""

    checkpoint: int  # the step of the checkpoint the run resumed from
    consumed: dict[str, int]  # the store's consumed-markers after the kill: group key -> step
    adoptable: set[str]  # finished groups no step before the checkpoint consumed
    records: int  # metrics.jsonl's step records after the kill
    orphans: list[str]  # the killed run's containers after the kill
    left: list[str]  # either run's containers after the resumed one ended


def _kill_and_resume(out: Path, sandbox: str, tmp_path: Path, client) -> Killed:
    runs = [Run(_args(out, sandbox, tmp_path), tmp_path / "train.log")]
    try:
        checkpoint = _kill(runs[0], out, client)
        orphans = [c.name for c in _containers(client, runs[0].pid)] if client is not None else []
        with TrajectoryStore(out / "trajectories.sqlite") as store:
            consumed = store.consumed()
            adoptable = {g.key for g in untrained_groups(store)} | {k for k, s in consumed.items() if s >= checkpoint}
        records = len(_step_records(out))
        runs.append(Run(["--resume", str(out), "--quiet"], runs[0].log))
        assert runs[1].process.wait(timeout=RUN_TIMEOUT_S) == 0, runs[1].tail()
        left = [c.name for c in _containers(client, runs[0].pid, runs[1].pid)] if client is not None else []
    finally:
        _end_leftovers(runs, out, client)
    return Killed(checkpoint, consumed, adoptable, records, orphans, left)


@pytest.mark.parametrize("sandbox", ["local", pytest.param("docker", marks=pytest.mark.docker)])
def test_a_run_killed_mid_step_resumes_and_trains_every_finished_group(sandbox, tmp_path, request):
    if sandbox == "local" and docker_available()[0]:  # the suite's minutes: the docker run checks all this and more
        pytest.skip("Docker answers: the docker variant covers the resume (which does not depend on the sandbox kind)")
    client = request.getfixturevalue("daemon") if sandbox == "docker" else None
    out = tmp_path / "run"
    k = _kill_and_resume(out, sandbox, tmp_path, client)
    c = k.checkpoint
    # What the checkpoint holds must be marked consumed before it is written, or the resume trains it again.
    kept = {key: step for key, step in k.consumed.items() if step < c}
    # (`RuntimeExecutor._train` marks a step's groups before its `train_step`, inside which the checkpoint is written)
    assert sorted(kept.values()) == [s for s in range(c) for _ in range(PROMPTS)], (c, k.consumed)
    resumed = _step_records(out)[k.records :]
    assert [r["step"] for r in resumed] == list(range(c, STEPS))
    # Adopted groups are handed out first; their episodes' timings come back from the group records.
    assert all(r["episodes"]["episode_s_sum"] > 0 for r in resumed), [r["episodes"] for r in resumed]
    with TrajectoryStore(out / "trajectories.sqlite") as store:
        after = store.consumed()
    assert k.adoptable, "no finished group was waiting when the run was killed"
    assert k.adoptable <= set(after)  # every finished group the killed run left was trained
    assert {key: after[key] for key in kept} == kept  # steps before the checkpoint stand
    assert sorted(after.values()) == [s for s in range(STEPS) for _ in range(PROMPTS)]  # each group once

    for version in (0, c):  # the killed run's engines, then the resumed ones, served these weights
        report = _consistent(out, version)
        assert report.token_mismatches == 0, report
        assert report.scored_tokens > 0, report
        assert report.max_logprob_diff < 1e-3, report

    if client is not None:
        assert k.orphans, "no sandbox of the killed run was left to reap"
        assert k.left == []


@pytest.mark.docker
@pytest.mark.parametrize("agent", ["builtin", "mini-swe-agent"])
def test_ctrl_c_stops_a_swe_run_in_one_line_and_leaves_no_container(agent, tmp_path, daemon):
    """SIGINT (what Ctrl-C sends) while episodes run in sandboxes: exit 130, the run's one line, no traceback, no
    retry of a manager that has gone (the task is closed while the manager still answers), no container left."""
    out, log = tmp_path / "run", tmp_path / "train.log"
    args = _args(out, "docker", tmp_path) + ["--set", f"task.options.agent={agent}"]
    run = Run(args, log)
    try:
        _wait_for(lambda: run.alive() and len(_containers(daemon, run.pid)) >= 2, RUN_TIMEOUT_S, "live sandboxes")
        before = log.read_text(errors="replace").count("\n")
        run.process.send_signal(signal.SIGINT)
        assert run.process.wait(timeout=180) == 130, run.tail()
        left = [c.name for c in _containers(daemon, run.pid)]
    finally:
        _end_leftovers([run], out, daemon)
    after = log.read_text(errors="replace").splitlines()[before:]
    assert not [line for line in after if "Traceback" in line or "Retrying" in line], "\n".join(after)
    assert after[-1].startswith(f"interrupted (Ctrl-C); outputs written so far are in {out}/"), "\n".join(after)
    assert left == []
