"""Docker for the `docker`-marked tests of swebench_env.

A docker-marked test is skipped, with the reason, when no Docker daemon answers, unless REQUIRE_DOCKER=1,
which makes it fail instead (CI sets it after `.ci/docker-setup`, so a broken Docker cannot pass as
skipped). The sandbox base image is built once a session (once a machine: it is cached by recipe hash).
"""

from __future__ import annotations

import os
from functools import cache

import pytest

from swebench_env.docker_util import docker_available, docker_client
from swebench_env.images import ensure_base_image
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
