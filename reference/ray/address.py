"""Whether a Ray cluster address can be reached, checked before Ray is asked to join it (Ray itself retries
an unreachable address for minutes, printing warnings, before it gives up)."""

from __future__ import annotations

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
