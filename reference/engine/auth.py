"""Engine authentication: one bearer token per engine process, held only by whoever started it.

An engine's own HTTP port can pause it, load weights from any local directory and generate. With a
token set, every endpoint but `/health` needs `Authorization: Bearer <token>`, compared in constant
time. The token reaches an engine process in its environment ($SEAMLESSFLOW_ENGINE_TOKEN, or a file
named by $SEAMLESSFLOW_ENGINE_TOKEN_FILE), never on its command line, which any local user can read
with `ps`. An engine without a token binds only a loopback address.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

TOKEN_ENV = "SEAMLESSFLOW_ENGINE_TOKEN"
TOKEN_FILE_ENV = "SEAMLESSFLOW_ENGINE_TOKEN_FILE"
MANAGER_TOKEN_ENV = "SEAMLESSFLOW_ADMIN_TOKEN"  # the trajectory manager's control token: never an engine's
OPEN_ENDPOINTS = frozenset({("GET", "/health"), ("HEAD", "/health")})  # liveness needs no token


def new_token() -> str:
    """A fresh secret for one engine process."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    """`token` if it can travel in an HTTP header: non-empty printable ASCII without spaces. The error
    never repeats the token."""
    if not isinstance(token, str) or not token or not all(33 <= ord(c) <= 126 for c in token):
        kind = f"a {len(token)}-character string" if isinstance(token, str) else type(token).__name__
        raise ValueError(f"an engine token must be a non-empty string of printable ASCII without spaces, got {kind}")
    return token


def token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The token from $SEAMLESSFLOW_ENGINE_TOKEN, else from the file $SEAMLESSFLOW_ENGINE_TOKEN_FILE names
    (surrounding whitespace stripped); None when neither is set."""
    if token := environ.get(TOKEN_ENV):
        return check_token(token)
    if path := environ.get(TOKEN_FILE_ENV):
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the engine token file {path!r} (${TOKEN_FILE_ENV}): {e}") from None
        return check_token(text.strip())
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str, token: str | None) -> None:
    """An engine reachable from other machines must check a token."""
    if token is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve an engine on non-loopback host {host!r} without a token: "
            f"set ${TOKEN_ENV} or ${TOKEN_FILE_ENV}, or bind 127.0.0.1"
        )


def bearer_headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


def authorized(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token`, compared in constant time. aiohttp decodes
    header bytes that are not UTF-8 into surrogates, which cannot be encoded back: not authorized."""
    if header is None:
        return False
    try:
        presented = header.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(presented, f"Bearer {token}".encode())


def auth_middleware(token: str):
    """An aiohttp middleware that answers 401 (JSON `{"error"}`) to a request without the token."""
    check_token(token)

    @web.middleware
    async def require_token(request: web.Request, handler):
        if (request.method, request.path) in OPEN_ENDPOINTS or authorized(request.headers.get("Authorization"), token):
            return await handler(request)
        return web.json_response(
            {"error": "this engine needs 'Authorization: Bearer <token>' with the token it was started with"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="engine"'},
        )

    return require_token
