"""The one way this package reaches Docker: a shared, thread-safe SDK client, or `DockerUnavailable`.

Every Docker call of `sandbox.py` and `images.py` goes through `docker_client()`, so a machine without
a daemon (or without the `docker` Python package) fails in one place with one exception type whose
message says how to get a daemon. The `docker` package is imported lazily: the rest of `swebench_env`
works without it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

API_TIMEOUT_S = 120  # one API call (exec streams are read with their own deadline, see sandbox.py)
POOL_SIZE = 64  # HTTP connections to the daemon: more than the sandboxes a process runs at once
START_HINT = (
    "start one with `sudo dockerd > /tmp/dockerd.log 2>&1 &`, or run `.ci/docker-setup` (installs Docker "
    "if missing and starts the daemon), or point DOCKER_HOST at a reachable daemon"
)

_lock = threading.Lock()
_shared: tuple[int, docker.DockerClient] | None = None  # (pid that connected, client): a forked child reconnects


class DockerUnavailable(RuntimeError):
    """No Docker daemon answers (or the `docker` SDK is missing); the message says how to get one."""


def docker_client(base_url: str | None = None) -> docker.DockerClient:
    """A client that has answered a ping: the process-wide one for the environment's daemon
    (DOCKER_HOST, else the local socket), or a fresh one for `base_url`. Raises `DockerUnavailable`."""
    global _shared
    if base_url is not None:
        return _connect(base_url)
    with _lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), _connect(None))
        return _shared[1]


def _connect(base_url: str | None) -> docker.DockerClient:
    try:
        import docker
    except ImportError as e:
        raise DockerUnavailable(
            "the `docker` Python package is not installed: pip install -e '.[swe]' (or pip install docker)"
        ) from e
    where = base_url or os.environ.get("DOCKER_HOST") or "the local socket (unix:///var/run/docker.sock)"
    try:
        if base_url is None:
            client = docker.from_env(timeout=API_TIMEOUT_S, max_pool_size=POOL_SIZE)
        else:
            client = docker.DockerClient(base_url=base_url, timeout=API_TIMEOUT_S, max_pool_size=POOL_SIZE)
        client.ping()
    except Exception as e:  # the SDK raises DockerException, requests' errors or OSError, by transport
        raise DockerUnavailable(f"no Docker daemon is reachable at {where} ({_first_line(e)}); {START_HINT}") from e
    return client


def docker_available() -> tuple[bool, str]:
    """(True, "") when the environment's daemon answers, else (False, why and how to start one)."""
    try:
        docker_client()
    except DockerUnavailable as e:
        return False, str(e)
    return True, ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
