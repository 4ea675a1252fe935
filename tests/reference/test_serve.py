"""End to end: `python -m reference serve` with the built-in engine in its own process, driven by the
official OpenAI client, a weight update in the middle of a generation, then `python -m reference check`."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

MODEL = "seamlessflow-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served(tmp_path, http):
    port, store = _free_port(), tmp_path / "trajectories.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reference", "serve", "--port", str(port), "--store", str(store), "--max-batch", "8"],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited: {proc.stderr.read()}")
        try:
            if http("GET", f"{url}/health", timeout_s=1)[0] == 200:
                break
        except OSError:
            time.sleep(0.2)
    try:
        yield url, store
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not Path(f"{store}.admin-token").exists()  # the generated control token goes with the server


def _control(store) -> dict:
    """The control token `serve` generated (none was given), as a header."""
    token = Path(f"{store}.admin-token")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600  # this user's alone
    return {"Authorization": f"Bearer {token.read_text().strip()}"}


@pytest.mark.slow
def test_serve_weight_update_mid_generation_then_check(served, http, openai_client):
    url, store = served
    results: dict[str, object] = {}

    def episode(name: str, turns: int, max_tokens: int) -> None:
        messages = [{"role": "user", "content": f"episode {name}: list three primes"}]
        with openai_client(f"{url}/s/{name}/v1") as client:
            for turn in range(turns):
                r = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=turn
                )
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"tool says: ok {turn}"}]  # fmt: skip
                results[f"{name}.{turn}"] = r

    underway = threading.Event()

    def long_episode() -> None:  # streams, so the test knows when tokens are flowing
        with openai_client(f"{url}/s/long/v1") as client:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a long story"}], max_tokens=400, seed=7,
                stream=True,
            )  # fmt: skip
            for n, chunk in enumerate(chunks):
                if n == 5:
                    underway.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    results["long"] = chunk.model_extra["trajectory"]

    long = threading.Thread(target=long_episode)
    long.start()
    assert underway.wait(120), "the long generation did not start"
    assert http("POST", f"{url}/admin/pause", {})[0] == 401  # without the generated token: refused
    control = _control(store)
    assert http("POST", f"{url}/admin/pause", {}, headers=control)[0] == 200
    assert http("POST", f"{url}/admin/update_weights", {"version": 1}, headers=control)[0] == 200
    assert http("POST", f"{url}/admin/resume", {}, headers=control)[0] == 200
    episode("multi", 3, 24)  # sessions keep working after the update
    long.join(120)

    versions = results["long"]["versions"]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    _, tree = http("GET", f"{url}/trajectories/multi", headers=control)
    assert tree["num_branches"] == 1 and len(tree["branches"][0]["request_ids"]) == 3

    check = subprocess.run(
        [sys.executable, "-m", "reference", "check", "--store", str(store)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    report = json.loads(check.stdout)
    assert report["sessions"] == 2 and report["requests"] == 4
    assert report["token_mismatches"] == 0
    assert report["scored_tokens"] == report["generated_tokens"] > 0
    assert report["max_logprob_diff"] < 1e-3  # the weights did not change, only the version label


@pytest.mark.slow
def test_checkpoint_engine_weight_update_from_directory(tmp_path, tok, openai_client):
    """An engine process serving a checkpoint directory; a weight update loads another directory;
    the consistency check matches each version's tokens to the weights that sampled them."""
    from reference.consistency import check_store
    from reference.engine.process import EngineProcess, EngineSpec
    from reference.manager.embedded import ManagerThread
    from reference.manager.manager import ManagerConfig
    from reference.model import build_model, load_checkpoint, save_checkpoint, tiny_config
    from reference.tokenizer import Tokenizer

    dirs = {}
    for seed in (1, 2):
        dirs[seed] = save_checkpoint(
            build_model(tiny_config(tok.vocab_size), seed=seed), tok, tmp_path / f"ckpt-{seed}"
        )
    tokenizer = Tokenizer.load(dirs[1])
    with EngineProcess(EngineSpec(model=str(dirs[1]))) as proc:
        m = ManagerThread({"e0": proc.client()}, tokenizer, tmp_path / "t.sqlite", ManagerConfig(model_name="ckpt"))
        with m, openai_client(m.base_url("ep")) as client:
            ask = [{"role": "user", "content": "hello"}]
            r0 = client.chat.completions.create(model="ckpt", messages=ask, max_tokens=12)
            m.call(m.manager.pause())
            m.call(m.manager.update_weights(1, str(dirs[2])))
            m.call(m.manager.resume())
            follow = [*ask, {"role": "assistant", "content": r0.choices[0].message.content},
                      {"role": "user", "content": "again"}]  # fmt: skip
            r1 = client.chat.completions.create(model="ckpt", messages=follow, max_tokens=12)
            assert set(r0.model_extra["trajectory"]["versions"]) == {0}
            assert set(r1.model_extra["trajectory"]["versions"]) == {1}
            old, new = load_checkpoint(dirs[1])[0], load_checkpoint(dirs[2])[0]
            v0 = check_store(m.store, old, tokenizer, version=0)
            v1 = check_store(m.store, new, tokenizer, version=1)
            stale = check_store(m.store, old, tokenizer, version=1)
    assert v0.token_mismatches == v1.token_mismatches == 0
    assert v0.scored_tokens == len(r0.model_extra["trajectory"]["token_ids"])
    assert v0.max_logprob_diff < 1e-3 and v1.max_logprob_diff < 1e-3
    assert stale.max_logprob_diff > 1e-2  # version-1 tokens were not sampled by the old weights
