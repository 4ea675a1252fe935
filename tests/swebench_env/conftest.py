"""Docker for the `docker`-marked tests of swebench_env.

A docker-marked test is skipped, with the reason, when no Docker daemon answers, unless REQUIRE_DOCKER=1,
which makes it fail instead (CI sets it after `.ci/docker-setup`, so a broken Docker cannot pass as
skipped). The sandbox base image is built once a session (once a machine: it is cached by recipe hash).
After the whole session, no container that these tests made is left: none owned by this process, none
whose owner is gone (a child process the tests started and killed), whatever the tests did.
"""

from __future__ import annotations

import os
from functools import cache

import pytest

from swebench_env.docker_util import DockerUnavailable, docker_available, docker_client
from swebench_env.images import ensure_base_image
from swebench_env.reaper import LABEL, Owner, is_stale
from swebench_env.sandbox import SandboxConfig

REQUIRE_ENV = "REQUIRE_DOCKER"


@cache
def _docker_state() -> tuple[bool, str]:
    return docker_available()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("docker") is None:
        return
    ok, why = _docker_state()
    if ok:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {why}", pytrace=False)
    pytest.skip(f"no Docker daemon (set {REQUIRE_ENV}=1 to fail instead): {why}")


@pytest.fixture(scope="session")
def daemon():
    """The shared Docker SDK client."""
    return docker_client()


@pytest.fixture(scope="session")
def base_image(daemon) -> str:
    """The offline-built sandbox base image (built on first use on this machine, then reused)."""
    return ensure_base_image(client=daemon)


@pytest.fixture(scope="session")
def sandbox_config(base_image) -> SandboxConfig:
    """Small limits, kind to a busy 2-core machine; a short client grace so hang tests end quickly."""
    return SandboxConfig(image=base_image, memory_mb=512, cpus=1.0, pids_limit=128, client_grace_s=5.0)


def _ours_or_orphaned(client) -> set[str]:
    """Sandbox containers owned by this process or by one that is gone (others' live ones are not ours)."""
    import time

    here, now = Owner.current(), time.time()
    names = set()
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}=1"}, ignore_removed=True):
        owner = Owner.from_labels(c.labels)
        if owner == here or is_stale(c.labels, here, now):
            names.add(c.name)
    return names


@pytest.fixture(scope="session", autouse=True)
def no_container_left_behind():
    """The daemon holds the same containers of ours after the session as before it."""
    try:
        client = docker_client()
    except DockerUnavailable:
        yield
        return
    before = {c.name for c in client.containers.list(all=True, ignore_removed=True)}
    yield
    left = _ours_or_orphaned(client) - before
    assert not left, f"containers left behind by the tests: {sorted(left)}"
