"""Web pages in the user's browser cannot drive the trajectory manager: a foreign `Host` (DNS rebinding) and a
cross-site `Origin` get 403 on every endpoint, with or without a token; agents, which send neither, are served."""

from __future__ import annotations

import json
import urllib.request

import pytest

from reference.manager.access import host_allowed, host_name
from reference.manager.manager import ManagerConfig

MODEL = "seamlessflow-tiny"


def call(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.mark.parametrize(
    "authority, name",
    [
        ("127.0.0.1:8000", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("LocalHost.:80", "localhost"),
        ("evil.example", "evil.example"),
    ],
)
def test_host_names_are_read_as_browsers_send_them(authority, name):
    assert host_name(authority) == name


def test_loopback_names_and_addresses_are_allowed_other_names_only_when_given():
    for ok in ("127.0.0.1:8000", "172.17.0.1:8000", "[::1]:9", "localhost:8000", "app.localhost", ""):
        assert host_allowed(ok), ok
    assert not host_allowed("evil.example:8000")
    assert not host_allowed("127.0.0.1.evil.example")
    assert host_allowed("node17:8000", ("node17",)) and host_allowed("anything", ("*",))


def test_a_cross_site_page_cannot_pause_engines_set_rewards_or_read_trajectories(fake_manager, http):
    m, _ = fake_manager(reply_tokens=4)
    status, _ = http("POST", f"{m.base_url('s1')}/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}]})  # fmt: skip
    assert status == 200  # an agent (no Origin) is served
    page = {"Origin": "http://evil.example"}
    status, err = call(f"{m.url}/admin/pause", "POST", {}, page)
    assert status == 403 and err["error"]["code"] == "forbidden_origin", err
    status, err = call(f"{m.url}/trajectories/s1", "POST", {"reward": 1.0}, page)
    assert status == 403, err
    assert call(f"{m.url}/trajectories/s1", headers=page)[0] == 403
    assert call(f"{m.url}/trajectories/s1", headers={"Sec-Fetch-Site": "cross-site"})[0] == 403
    status, tree = call(f"{m.url}/trajectories/s1")
    assert status == 200 and tree.get("annotations", {}).get("reward") is None  # the reward was not set
    # the engines were not paused: an agent's next turn is answered
    status, _ = http("POST", f"{m.base_url('s2')}/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "again"}]}, timeout_s=20)  # fmt: skip
    assert status == 200
    # the server's own pages (same origin) and a page on the user's machine at the same address are served
    own = m.url.removeprefix("http://")
    assert call(f"{m.url}/trajectories/s1", headers={"Origin": f"http://{own}"})[0] == 200


def test_a_rebound_name_gets_403_on_every_endpoint_token_or_not(fake_manager):
    m, _ = fake_manager(config=ManagerConfig(default_max_tokens=64, admin_token="secret"))
    port = m.url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}", "Authorization": "Bearer secret"}
    for method, path, body in (("GET", "/health", None), ("GET", "/trajectories", None),
                               ("POST", "/admin/pause", {}), ("POST", "/s/x/v1/chat/completions",
                                                              {"model": MODEL, "messages": []})):  # fmt: skip
        status, err = call(f"{m.url}{path}", method, body, rebound)
        assert status == 403 and err["error"]["code"] == "forbidden_host", (path, err)
    cross = {"Origin": "http://evil.example", "Authorization": "Bearer secret"}
    assert call(f"{m.url}/admin/resume", "POST", {}, cross)[0] == 403  # the token does not make a page welcome
    assert (
        call(f"{m.url}/trajectories", headers={"Host": f"localhost:{port}", "Authorization": "Bearer secret"})[0] == 200
    )


def test_names_and_origins_can_be_allowed(fake_manager):
    config = ManagerConfig(default_max_tokens=64, allowed_hosts=("node17",),
                           allowed_origins=("http://dash.example:3000",))  # fmt: skip
    m, _ = fake_manager(config=config)
    port = m.url.rsplit(":", 1)[1]
    assert call(f"{m.url}/trajectories", headers={"Host": f"node17:{port}"})[0] == 200
    assert call(f"{m.url}/trajectories", headers={"Origin": "http://dash.example:3000"})[0] == 200
    assert call(f"{m.url}/trajectories", headers={"Origin": "http://dash.example:3001"})[0] == 403
    with pytest.raises(ValueError, match="allowed_hosts must be a list of non-empty names"):
        ManagerConfig(allowed_hosts=("",))


def test_cached_tokens_do_not_let_a_session_id_read_the_sessions_prompt(fake_manager, http, tok):
    """Someone who knows a session's id (not its token) used to read its prompt a token at a time: a guessed
    prefix came back counted in `cached_tokens`. Only a whole history counts now (up to a model reply's end),
    as an agent's next turn has."""
    m, _ = fake_manager(reply_tokens=4)
    url = f"{m.base_url('victim')}/completions"
    secret = tok.encode("the launch code is 7 3 9 1")
    status, first = http("POST", url, {"model": MODEL, "prompt": secret, "max_tokens": 4})
    assert status == 200
    reply = first["trajectory"]["token_ids"]
    for n in (2, len(secret) // 2, len(secret), len(secret) + 2):  # prefixes of the prompt, then into the reply
        _, probe = http("POST", url, {"model": MODEL, "prompt": (secret + reply)[:n] + [5], "max_tokens": 1})
        assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, n
    # the agent's own next turn (its prompt, the model's reply, more) is credited with all of it
    _, again = http("POST", url, {"model": MODEL, "prompt": secret + reply + [5, 6], "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(secret) + len(reply)
