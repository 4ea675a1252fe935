"""Who may call the trajectory manager's HTTP server, and how every refusal and error is answered.

A web page in the user's browser must not drive the manager: a Host that is not this machine's (DNS
rebinding), an Origin other than the server's own, or a request the browser marks cross-site gets a 403 on
every endpoint. With an admin token set, everything except the agents' own `/s/<session>/v1/*` calls,
`/v1/models` and `/health` needs `Authorization: Bearer <token>`. Every error is an OpenAI-style JSON body
(`openai_errors`); a URL nothing serves gets a 404 that says where the OpenAI endpoints are.
"""

from __future__ import annotations

import ipaddress
import logging

from aiohttp import web

from reference.engine.auth import authorized
from reference.manager.chat import RequestError
from reference.manager.manager import TrajectoryManager

log = logging.getLogger(__name__)

MANAGER_KEY = web.AppKey("manager", TrajectoryManager)
OPEN_PATHS = ("/health", "/v1/models")  # needing no token (besides the agents' /s/<session>/v1/*)


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        _check_web_origin(request)  # every endpoint, token or not: a web page must not drive the manager
        if isinstance(request.match_info.http_exception, web.HTTPNotFound):
            raise _no_such_endpoint(request)  # before the token check: an agent with a wrong base URL is told so
        if not (request.path.startswith("/s/") or request.path in OPEN_PATHS):
            _check_token(request)
        return await handler(request)
    except RequestError as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.text if e.status == 413 and e.text else e.reason)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path[:200])
        return error_response(500, "internal server error")


def error_response(status: int, message: str) -> web.Response:
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    return web.json_response(RequestError(message, status=status, code=code).body(), status=status)


def _no_such_endpoint(request: web.Request) -> RequestError:
    """The 404 for a URL nothing serves; it says where the OpenAI endpoints are, since a client given the
    usual `http://HOST:PORT/v1` base URL lands here."""
    return RequestError(
        f"{request.method} {request.path[:100]} is not served here: OpenAI calls take the session in the URL. "
        f"Use base_url = {request.scheme}://{request.host[:100]}/s/<session_id>/v1 (one session id per agent "
        f"episode), which serves POST chat/completions, POST completions and GET models",
        status=404,
        code="not_found",
    )


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def host_name(authority: str) -> str:
    """The host of a Host header or an origin's authority, lower case, without its port, brackets or final dot."""
    host = authority.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def host_allowed(authority: str, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a request naming this Host may be served: an IP address or a loopback name (a page that rebinds
    its domain to this machine still names its domain), or a name in `allowed` ("*": any)."""
    name = host_name(authority)
    if not name or "*" in allowed or name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return name in {host_name(a) for a in allowed}


def _check_web_origin(request: web.Request) -> None:
    """403 for what a web page in the user's browser sends: a Host that is not this machine's (DNS rebinding), an
    Origin other than this server's own, or a request the browser marks cross-site. Agents and other clients
    that are not browsers send no Origin."""
    config = request.app[MANAGER_KEY].config
    host = request.headers.get("Host", "")
    if not host_allowed(host, config.allowed_hosts):
        raise RequestError(
            f"Host {host[:100]!r} is not served here: a loopback name or an IP address, or a name "
            f"given with --allowed-host",
            status=403,
            code="forbidden_host",
        )
    origin = request.headers.get("Origin")
    own = origin is not None and origin.partition("://")[2].lower() == host.lower()
    if origin is not None and not own and "*" not in config.allowed_origins and origin not in config.allowed_origins:
        raise RequestError(
            f"Origin {origin[:100]!r} may not call this server: browsers' cross-site requests are "
            f"refused unless the origin is given with --allowed-origin",
            status=403,
            code="forbidden_origin",
        )
    if origin is None and request.headers.get("Sec-Fetch-Site") == "cross-site" and "*" not in config.allowed_origins:
        raise RequestError(
            "a cross-site request from a browser may not call this server", status=403, code="forbidden_origin"
        )


def _check_token(request: web.Request) -> None:
    token = request.app[MANAGER_KEY].config.admin_token
    if token is None:
        return
    if not authorized(request.headers.get("Authorization"), token):
        raise RequestError(
            f"{request.path[:100]} needs 'Authorization: Bearer <admin token>'", status=401, code="unauthorized"
        )
