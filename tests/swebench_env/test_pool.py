"""The sandbox pool for real: leases that do not wait for a start, spares started ahead, the slot limit, every
container removed (episode ended, crashed, pool closed, owner killed), and the spans the timeline draws.

Nothing here sleeps and then asserts: waits are on conditions with deadlines (a busy 2-core machine)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.tags import SandboxPhase as K
from swebench_env.pool import SandboxPool, Span, _with_gaps
from swebench_env.sandbox import SandboxConfig, SandboxError
from swebench_env.suite import load_suite

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0
# A child process whose pool holds a leased container and a started spare when it is SIGKILLed.
KILLED_OWNER = """
import sys, time
from swebench_env.pool import SandboxPool
from swebench_env.sandbox import SandboxConfig
pool = SandboxPool(1, spares=1)
config = SandboxConfig(image=sys.argv[1], memory_mb=256)
with pool.lease(config) as lease:
    lease.exec("true", 60)
    deadline = time.monotonic() + 170
    while pool.stats().spares_ready < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(" ".join([lease.name, *pool.names()["spare"]]), flush=True)
    lease.exec("sleep 600", 900)
"""


def wait_until(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"not within {deadline_s:g} s: {what}")
        time.sleep(0.05)


def _exists(daemon, name: str) -> bool:
    return bool(daemon.containers.list(all=True, filters={"name": f"^{name}$"}, ignore_removed=True))


def _mine(daemon) -> set[str]:
    """This process's sandbox containers."""
    label = f"seamlessflow.owner_pid={os.getpid()}"
    return {c.name for c in daemon.containers.list(all=True, filters={"label": label}, ignore_removed=True)}


@pytest.fixture
def config(base_image) -> SandboxConfig:
    return SandboxConfig(image=base_image, memory_mb=256, client_grace_s=5.0)


# --- without Docker -----------------------------------------------------------------------------


def test_gaps_between_a_leases_spans_are_filled_with_its_gap_kind():
    spans = [Span("sandbox-0", K.START, 0.0, 1.0), Span("sandbox-0", K.SPARE, 1.0, 5.0),
             Span("sandbox-0", K.TOOL, 7.0, 7.5), Span("sandbox-0", K.TOOL, 9.0, 12.0)]  # fmt: skip
    assert _with_gaps(spans, 5.0, 10.0, K.MODEL, "sandbox-0") == [
        Span("sandbox-0", K.START, 0.0, 1.0),
        Span("sandbox-0", K.SPARE, 1.0, 5.0),
        Span("sandbox-0", K.MODEL, 5.0, 7.0),
        Span("sandbox-0", K.TOOL, 7.0, 7.5),
        Span("sandbox-0", K.MODEL, 7.5, 9.0),
        Span("sandbox-0", K.TOOL, 9.0, 10.0),  # clipped to the lease's end
    ]


def test_a_lease_with_a_start_still_under_way_gets_the_gap_kind_only_after_it():
    spans = [Span("sandbox-1", K.START, 2.0, 4.0)]
    assert _with_gaps(spans, 2.0, 6.0, K.MODEL, "sandbox-1") == [
        Span("sandbox-1", K.START, 2.0, 4.0),
        Span("sandbox-1", K.MODEL, 4.0, 6.0),
    ]


@pytest.mark.parametrize("slots, spares", [(0, 1), (1, -1), (1.5, 1)])
def test_bad_pool_sizes_are_refused_naming_the_value(slots, spares):
    with pytest.raises(ValueError, match="must be an integer"):
        SandboxPool(slots, spares, client=object())


# --- with Docker --------------------------------------------------------------------------------


@pytest.mark.docker
def test_a_lease_returns_before_its_container_starts_and_its_first_command_waits(daemon, config):
    with SandboxPool(1, spares=0, client=daemon) as pool:
        opened = time.monotonic()
        with pool.lease(config) as lease:
            open_s = time.monotonic() - opened
            assert lease.exec("echo hi", 60).output == "hi\n"
            assert lease.exec("true", 60).exit_code == 0
        assert open_s < 0.5  # not a start's second or more: the start runs in the background ...
        assert lease.waited_s > 0.0  # ... and the first command waited for it
        assert [s.kind for s in lease.spans if s.kind is not K.MODEL] == [K.START, K.TOOL, K.TOOL]
        assert {s.lane for s in lease.spans} == {"sandbox-0"}
        wait_until(lambda: not _exists(daemon, lease.name), "the leased container removed after the lease")
        assert pool.stats().spare_misses == 1


@pytest.mark.docker
def test_a_spare_is_started_ahead_and_the_next_lease_takes_it_without_waiting(daemon, config):
    with SandboxPool(1, spares=1, client=daemon) as pool:
        with pool.lease(config) as first:
            first.exec("true", 60)
        wait_until(lambda: pool.stats().spares_ready == 1, "a spare started")
        (spare,) = pool.names()["spare"]
        with pool.lease(config) as second:
            assert second.name == spare
            assert second.exec("echo ok", 60).output == "ok\n"
        assert second.waited_s == 0.0
        assert [s.kind for s in second.spans][:2] == [K.START, K.SPARE]
        stats = pool.stats()
        assert (stats.spare_hits, stats.spare_misses) == (1, 1)
        wait_until(lambda: pool.stats().spares_ready == 1, "another spare started behind the one taken")
        left = pool.names()["spare"]
    assert all(not _exists(daemon, name) for name in [first.name, second.name, *left])  # close removed the spare


@pytest.mark.docker
def test_a_lease_past_the_slots_waits_for_a_free_one(daemon, config):
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()
    with SandboxPool(1, spares=0, client=daemon) as pool:

        def first() -> None:
            with pool.lease(config):
                order.append("first opened")
                holding.set()
                release.wait(DEADLINE_S)
                order.append("first ends")

        def second() -> None:
            with pool.lease(config):
                order.append("second opened")

        a = threading.Thread(target=first)
        a.start()
        assert holding.wait(DEADLINE_S)
        b = threading.Thread(target=second)
        b.start()
        wait_until(lambda: pool.stats().leased == 1 and b.is_alive(), "the second lease waiting")
        release.set()
        a.join(DEADLINE_S)
        b.join(DEADLINE_S)
    assert order == ["first opened", "first ends", "second opened"]


@pytest.mark.docker
def test_a_crashed_episodes_container_is_removed_and_a_failed_start_is_a_sandbox_error(daemon, config):
    with SandboxPool(2, spares=0, client=daemon) as pool:
        with pytest.raises(RuntimeError, match="the agent crashed"), pool.lease(config) as lease:
            lease.exec("true", 60)
            raise RuntimeError("the agent crashed")
        wait_until(lambda: not _exists(daemon, lease.name), "the crashed episode's container removed")
        missing = SandboxConfig(image="seamlessflow/no-such-image:0", memory_mb=256)
        with pool.lease(missing) as broken, pytest.raises(SandboxError, match="no-such-image"):
            broken.exec("true", 60)
        wait_until(lambda: pool.stats().containers == 0, "the pool holding no container")


@pytest.mark.docker
def test_a_lease_ended_before_its_start_is_done_removes_the_container_when_it_is(daemon, config):
    with SandboxPool(1, spares=0, client=daemon) as pool:
        with pool.lease(config) as lease:
            pass  # the episode ended (its agent failed at once) while the container was still starting
        wait_until(lambda: pool.stats().containers == 0, "the container removed once started")
    assert not _exists(daemon, lease.name)


@pytest.mark.docker
def test_a_pooled_episode_works_in_the_tasks_checkout_and_is_graded_like_any_other(daemon, base_image):
    task = next(t for t in load_suite("train") if t.patch)
    with SandboxPool(1, spares=1, client=daemon) as pool:
        episode = pool.episode(base_image, test_timeout_s=120)
        with episode.workspace(task) as runner:
            head = runner.exec("git rev-parse HEAD", 60)
            assert (head.exit_code, head.output.strip()) == (0, task.base_commit)
            assert runner.exec("git status --short", 60).output == ""
        evaluation = episode.grader(task, task.patch)
    assert evaluation.resolved
    kinds = [s.kind for s in episode.spans]
    assert kinds.count(K.TEST_RUN) == 1
    assert kinds.count(K.TOOL) == 2
    assert K.START in kinds
    assert episode.wait_s == episode.agent_wait_s + episode.grader_wait_s


@pytest.mark.docker
def test_a_killed_runs_pool_containers_are_removed_when_a_swe_task_starts(daemon, base_image):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, base_image], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(owner.stdout, selectors.EVENT_READ)
            assert sel.select(DEADLINE_S), "the child printed nothing"
        names = owner.stdout.readline().split()
    finally:
        owner.kill()
        owner.wait(timeout=60)
    assert len(names) == 2  # the leased container and the spare
    assert all(_exists(daemon, name) for name in names)  # SIGKILL: no clean-up ran
    from reference.tasks import make_task

    task = make_task("swe", sandbox="docker")
    task.close()
    assert not any(_exists(daemon, name) for name in names)


@pytest.mark.docker
def test_the_rollout_command_runs_its_docker_episodes_from_a_pool_and_leaves_no_container(daemon, base_image, tmp_path,
                                                                                          capsys):  # fmt: skip
    from swebench_env import cli
    from swebench_env.scripted import demonstration_manager
    from swebench_env.suite import SUITE_DIR, load_suite_demonstrations

    pairs = list(zip(load_suite("train"), load_suite_demonstrations("train"), strict=True))[:2]
    before = _mine(daemon)
    out = tmp_path / "out"
    with demonstration_manager(pairs, store=tmp_path / "t.sqlite") as m:
        argv = ["rollout", "--tasks", str(SUITE_DIR / "train.jsonl"), "--ids", *(t.instance_id for t, _ in pairs),
                "--base-url", m.url, "--out", str(out), "--sandbox", "docker", "--image", base_image,
                "--concurrency", "2", "--max-turns", "12"]  # fmt: skip
        assert cli.main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("pass@1: 2/2 = 100.0%")
    assert _mine(daemon) <= before  # the pool closed with the command: no spare, no episode's container left


@pytest.mark.docker
def test_a_spare_that_failed_to_start_is_never_handed_out(daemon):
    missing = SandboxConfig(image="seamlessflow/no-such-image:0", memory_mb=256)
    with SandboxPool(1, spares=1, client=daemon) as pool:
        for _ in range(2):  # the second lease finds no failed spare: it fails on its own start, not a spare's
            with pool.lease(missing) as lease, pytest.raises(SandboxError, match="no-such-image"):
                lease.exec("true", 60)
            wait_until(lambda: pool.stats().containers == 0, "the failed spare forgotten")
        assert pool.stats().spare_hits == 0
