"""Whether a Ray cluster address can be reached, checked before Ray is asked to join it (Ray itself retries
an unreachable address for minutes, printing warnings, before it gives up); and, for a run that starts its own
local Ray, that no cluster is there for Ray to join instead (`ray start`, or a test's, left running: Ray would
refuse the run's own sizes with "num_cpus and num_gpus must not be provided")."""

from __future__ import annotations

import os
import socket

from core.errors import UserError

DEFAULT_PORTS = {"": 6379, "ray": 10001}  # the GCS port of `ray start --head`; the Ray client's port


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """UserError (one line) unless a TCP connection to `address` (`host:port`, `ray://host:port` or
    `auto`, which Ray resolves itself) opens within `timeout_s`."""
    if address == "auto":
        return
    scheme, _, rest = address.rpartition("://")
    if scheme not in DEFAULT_PORTS:
        raise UserError(f"--ray-address {address!r}: expected host:port, ray://host:port or auto")
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    try:
        port_number = int(port) if port else DEFAULT_PORTS[scheme]
    except ValueError:
        raise UserError(f"--ray-address {address!r}: the port {port!r} is not a number") from None
    if not host or not 0 < port_number < 65536:
        raise UserError(f"--ray-address {address!r}: expected host:port with a port in 1-65535")
    try:
        with socket.create_connection((host, port_number), timeout=timeout_s):
            pass
    except OSError as e:
        raise UserError(f"cannot reach the Ray cluster at {address!r}: {e.strerror or e}") from None


def running_cluster() -> str | None:
    """The address of the Ray cluster that a plain `ray.init()` here would join rather than start its own:
    RAY_ADDRESS if set, else the one `ray start` (or a test's `ray.cluster_utils.Cluster`) recorded in Ray's
    temporary directory (`ray_current_cluster`, removed by `ray stop`); None when there is none."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env
    try:
        from ray._private.utils import read_ray_address  # the lookup ray.init makes
    except ImportError:  # Ray moved it: RayWorkers still turns ray.init's refusal into a UserError
        return None
    return read_ray_address()


def check_no_running_cluster() -> None:
    """UserError (one line, naming the fix) when a run that starts its own local Ray would join a cluster that is
    already there instead (`running_cluster`)."""
    address = running_cluster()
    if address is None:
        return
    if os.environ.get("RAY_ADDRESS", "").strip():
        raise UserError(
            f"RAY_ADDRESS is set ({address}), so Ray would join that cluster, but a run without --ray-address "
            f"starts its own: unset RAY_ADDRESS, or pass --ray-address {address}"
        )
    raise UserError(
        f"a Ray cluster is already running on this machine ({address}: left by `ray start` or a test), which Ray "
        "would join, but a run without --ray-address starts its own: stop it with `ray stop`, or join it with "
        '--ray-address auto (its nodes must offer the tags, e.g. ray start --head --resources=\'{"rollout": 2, '
        '"train": 1}\')'
    )
