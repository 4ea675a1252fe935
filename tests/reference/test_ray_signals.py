"""Starting Ray keeps the run's SIGTERM handler: `ray.init` installs `sys.exit` for SIGTERM, which would skip
a run's clean stop (`core.cli.Terminated`, the SWE task's sandboxes removed)."""

from __future__ import annotations

import signal

import pytest

ray = pytest.importorskip("ray")


def test_starting_ray_keeps_the_sigterm_handler():
    from reference.ray.workers import RayWorkers

    if ray.is_initialized():
        pytest.skip("Ray is already running in this process: RayWorkers would not start it")

    def handler(signum, frame):  # pragma: no cover - never called
        raise AssertionError("not expected to run")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with RayWorkers([]) as workers:
            assert workers._started_ray
            assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not ray.is_initialized()
