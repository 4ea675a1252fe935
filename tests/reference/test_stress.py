"""Many agents, repeated pause / weight update / resume cycles and agents that walk away mid-request,
against the built-in engine in its own process: nothing hangs, nothing is corrupted."""

from __future__ import annotations

import threading
import time

import pytest

MODEL = "seamlessflow-tiny"


@pytest.mark.slow
def test_agents_survive_weight_update_storm(tok, tmp_path, openai_client, http):
    import openai

    from reference.consistency import check_store
    from reference.engine.process import EngineProcess, EngineSpec
    from reference.manager.embedded import ManagerThread
    from reference.model import default_model

    sessions, turns = 10, 3
    walkers = {1, 4, 7}  # these sessions abandon their second turn after 0.2 s
    outcomes: dict[str, list] = {f"s{i}": [] for i in range(sessions)}
    errors: list[BaseException] = []

    def agent(name: str, m: ManagerThread) -> None:
        messages = [{"role": "user", "content": f"{name}: start"}]
        try:
            # A request lives through many pause / update / resume cycles, each re-prefilling it: on a machine
            # busy with other work one took over a minute. A hung request still fails the test: its client
            # gives up after 600 s, within the suite's per-test limit of 900 s.
            with openai_client(m.base_url(name), timeout_s=600) as client:
                for turn in range(turns):
                    if turn == 1 and int(name[1:]) in walkers:
                        impatient = openai.OpenAI(base_url=m.base_url(name), api_key="x", max_retries=0, timeout=0.2)
                        with pytest.raises(openai.APITimeoutError):
                            impatient.chat.completions.create(model=MODEL, messages=messages, max_tokens=200)
                        impatient.close()
                        continue
                    r = client.chat.completions.create(
                        model=MODEL, messages=messages, max_tokens=48, seed=turn, temperature=1.0
                    )
                    outcomes[name].append(r)
                    messages += [{"role": "assistant", "content": r.choices[0].message.content},
                                 {"role": "user", "content": f"observation {turn}"}]  # fmt: skip
        except BaseException as e:  # surfaced by the main thread
            errors.append(e)

    with (
        EngineProcess(EngineSpec(max_batch=8)) as proc,
        ManagerThread({"e0": proc.client()}, tok, tmp_path / "storm.sqlite") as m,
    ):
        threads = [threading.Thread(target=agent, args=(f"s{i}", m)) for i in range(sessions)]
        for t in threads:
            t.start()
        version, engine, last = 0, proc.client(), 0
        while any(t.is_alive() for t in threads):
            # Update once the engine has made some progress since the last update, however slow the
            # machine: partial rollout re-prefills every running request at each update.
            generated = m.call(engine.stats()).extra["tokens_generated"]
            if generated < last + 40:
                time.sleep(0.05)
                continue
            last = generated
            m.call(m.manager.pause(), timeout_s=60)
            version += 1
            m.call(m.manager.update_weights(version), timeout_s=60)
            m.call(m.manager.resume(), timeout_s=60)
        for t in threads:
            t.join(5)
        assert not errors, errors
        stats = m.call(engine.stats())
        m.call(engine.close())
        report = check_store(m.store, default_model()[0], tok)
        trees = {name: http("GET", f"{m.url}/trajectories/{name}")[1] for name in outcomes}

    assert stats.running == 0 and stats.waiting == 0
    assert version >= 3
    seen_versions = set()
    for name, responses in outcomes.items():
        assert len(responses) == turns - (int(name[1:]) in walkers)
        for r in responses:
            v = r.model_extra["trajectory"]["versions"]
            assert v == sorted(v) and r.choices[0].finish_reason in ("stop", "length")
            seen_versions.update(v)
        tree = trees[name]
        assert tree["num_branches"] == 1 and len(tree["branches"][0]["request_ids"]) == len(responses)
    assert len(seen_versions) >= 2
    assert report.requests == sum(len(r) for r in outcomes.values())
    assert report.token_mismatches == 0 and report.max_logprob_diff < 1e-3
