"""A newcomer's mistakes with `python -m reference`: each is one `error:` line and exit code 2, found before
anything starts or is written; Ctrl-C is exit code 130 without a traceback; a client given the usual `/v1`
base URL is told where the OpenAI endpoints are.

Refusals are checked through `main` in this process (it is what `python -m reference` runs); a port in use
and Ctrl-C, where what the user sees depends on the whole process, run the command in a subprocess.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading

import pytest

from reference.cli import main
from reference.manager.manager import ManagerConfig

CLI = [sys.executable, "-m", "reference"]
HINT = "/s/<session_id>/v1"


@pytest.fixture
def taken_port():
    """A port something else listens on (a second `make serve` finds the first one's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _refused(capsys, argv: list[str]) -> str:
    """The one stderr line of a command `main` refuses with exit code 2."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


def _run_refused(argv: list[str]) -> str:
    """The one stderr line of a command refused in its own process, with exit code 2."""
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: "), done.stderr  # no "starting ... engine(s)" line before it
    assert done.stderr.count("\n") == 1, done.stderr
    return done.stderr


# ---- ports and hosts: checked before any engine starts ----


def test_serve_on_a_port_in_use_is_one_line_and_writes_nothing(taken_port, tmp_path):
    store = tmp_path / "t.sqlite"
    line = _run_refused(["serve", "--backend", "fake", "--port", str(taken_port), "--store", str(store)])
    assert f"127.0.0.1:{taken_port}" in line
    assert "in use" in line
    assert not store.exists()


def test_engine_on_a_port_in_use_is_one_line(taken_port):
    line = _run_refused(["engine", "--backend", "fake", "--port", str(taken_port)])
    assert f"127.0.0.1:{taken_port}: the port is in use" in line


@pytest.mark.parametrize("command", ["serve", "engine"])
def test_a_port_out_of_range_is_refused(command, capsys, tmp_path):
    store = tmp_path / "t.sqlite"
    extra = ["--store", str(store)] if command == "serve" else []
    line = _refused(capsys, [command, "--backend", "fake", "--port", "99999", *extra])
    assert "port 99999" in line
    assert "0-65535" in line
    assert not store.exists()


@pytest.mark.parametrize(("command", "token_env"), [("serve", "SEAMLESSFLOW_ADMIN_TOKEN"),
                                                    ("engine", "SEAMLESSFLOW_ENGINE_TOKEN")])  # fmt: skip
def test_an_unresolvable_host_is_refused(command, token_env, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(token_env, "a-token-so-that-a-non-loopback-host-is-allowed")
    store = tmp_path / "t.sqlite"
    extra = ["--store", str(store)] if command == "serve" else []
    line = _refused(capsys, [command, "--backend", "fake", "--host", "no-such-host.invalid", "--port", "0", *extra])
    assert "'no-such-host.invalid'" in line
    assert "127.0.0.1" in line  # what to use instead
    assert not store.exists()


# ---- flag values: one line naming the flag, nothing written ----


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--engines", "0"], "--engines must be >= 1"),
        (["--engines", "-1"], "--engines must be >= 1"),
        (["--max-in-flight", "-1"], "--max-in-flight must be >= 0"),
        (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
        (["--max-pause-s", "nan"], "--max-pause-s must be >= 0"),
        (["--body-timeout-s", "0"], "--body-timeout-s must be in 0.001..3600, got 0.0"),
        (["--max-body-bytes-in-flight", "0"], "--max-body-bytes-in-flight must be >= 1, got 0"),
        (["--allowed-host", " "], "--allowed-host must name a host or an origin, got ' '"),
        (["--heartbeat-s", "0"], "--heartbeat-s must be > 0"),
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--reply-tokens", "0"], "--reply-tokens must be >= 1"),
        (["--seed", "-1"], "--seed must be in 0.."),
        (["--backend", "vllm"], "engine backend 'vllm' needs a local checkpoint directory as its model (--model DIR)"),
        (["--engine-url", "localhost:9000"], "--engine-url must be http://HOST:PORT"),
    ],
)
def test_a_bad_serve_flag_names_the_flag(flags, named, capsys, tmp_path):
    store = tmp_path / "t.sqlite"
    line = _refused(capsys, ["serve", "--backend", "fake", "--port", "0", "--store", str(store), *flags])
    assert named in line
    assert not store.exists()


def test_the_control_token_settings_are_checked_before_anything_starts(capsys, tmp_path, monkeypatch):
    store = tmp_path / "t.sqlite"
    base = ["serve", "--backend", "fake", "--port", "0", "--store", str(store)]
    monkeypatch.setenv("SEAMLESSFLOW_ADMIN_TOKEN", "secret")
    assert "--no-admin-token with a token given" in _refused(capsys, [*base, "--no-admin-token"])
    monkeypatch.delenv("SEAMLESSFLOW_ADMIN_TOKEN")
    target = tmp_path / "elsewhere"
    (tmp_path / "t.sqlite.admin-token").symlink_to(target)  # a link planted where the token goes
    assert "is not a regular file" in _refused(capsys, base)
    assert not target.exists() and not store.exists()


def test_a_bad_engine_flag_names_the_flag(capsys):
    assert "--token-delay-s must be >= 0" in _refused(capsys, ["engine", "--backend", "fake", "--token-delay-s", "-1"])


@pytest.mark.parametrize("command", [["check"], ["export", "--out", "OUT"]])
def test_check_and_export_without_a_store_write_nothing(command, capsys, tmp_path):
    store, out = tmp_path / "missing.sqlite", tmp_path / "out.jsonl"
    argv = [str(out) if a == "OUT" else a for a in command]
    line = _refused(capsys, [*argv, "--store", str(store)])
    assert f"no trajectory store at {store}" in line
    assert list(tmp_path.iterdir()) == []


# ---- Ctrl-C ----


def _lines(stream, into: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    ("argv", "ready"),
    [
        (["serve", "--backend", "fake", "--port", "0", "--store", "STORE"], r"http://127\.0\.0\.1:[1-9]\d*/s/"),
        (["engine", "--backend", "fake"], r"ENGINE READY port=[1-9]"),
    ],
)
def test_ctrl_c_on_a_running_command_exits_130_without_a_traceback(argv, ready, tmp_path, wait_for):
    argv = [str(tmp_path / "t.sqlite") if a == "STORE" else a for a in argv]
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    readers = [_lines(proc.stdout, out), _lines(proc.stderr, err)]
    try:
        # `serve` prints its real port (not the 0 it was given) once it serves; `engine` announces its port
        wait_for(lambda: proc.poll() is not None or any(re.search(ready, line) for line in out + err),
                 timeout_s=120, what="the command to serve")  # fmt: skip
        assert proc.poll() is None, "".join(err)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    for reader in readers:
        reader.join(timeout=30)
    assert "Traceback" not in "".join(err)


# ---- a client given the usual /v1 base URL ----


@pytest.mark.parametrize("admin_token", [None, "s3cret"])
def test_a_client_at_slash_v1_is_told_to_use_the_session_url(admin_token, fake_manager, openai_client):
    import openai

    m, _ = fake_manager(config=ManagerConfig(admin_token=admin_token))
    with openai_client(f"{m.url}/v1") as client:
        assert [model.id for model in client.models.list()] == ["seamlessflow-tiny"]  # still served
        with pytest.raises(openai.NotFoundError) as refused:
            client.chat.completions.create(model="seamlessflow-tiny", messages=[{"role": "user", "content": "hi"}])
    assert f"base_url = {m.url}{HINT}" in refused.value.message
    assert refused.value.body["code"] == "not_found"


@pytest.mark.parametrize(("method", "path"), [("GET", "/"), ("POST", "/chat/completions"),
                                              ("POST", "/v1/completions"), ("GET", "/s/a/v1/embeddings")])  # fmt: skip
def test_every_unserved_url_gets_an_openai_json_404_with_the_hint(method, path, fake_manager, http):
    m, _ = fake_manager()
    status, body = http(method, f"{m.url}{path}", {} if method == "POST" else None)
    assert status == 404
    assert body["error"]["type"] == "invalid_request_error"
    assert f"{method} {path} is not served here" in body["error"]["message"]
    assert HINT in body["error"]["message"]
