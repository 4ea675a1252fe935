"""The object-store weight transport's parts, without Ray: the payload a trainer hands off (cast to the engines'
dtype) and the version directory a worker writes from it on its node; a worker's copies, pruned to the newest few
and the one its engine holds; the initial weights shipped to a worker; the transport's bookkeeping (each engine
loads its own copy, a payload is released once every copy is made, a failed copy stops the run); and the
trajectory manager loading each engine from its own source. The two-node run is in test_two_node_handoff.py."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from reference.control.calls import LocalWorkers
from reference.control.transport import ObjectStoreTransport
from reference.control.worker import ResourceWorker, WeightsCopy, WorkerSpec
from reference.engine.builtin import BuiltinEngine
from reference.engine.fake import FakeEngine
from reference.engine.process import EngineSpec
from reference.model import build_model, load_checkpoint, tiny_config
from reference.tasks.tokenizer import task_tokenizer
from reference.trainer.handoff import (
    KEEP_LATEST_VERSIONS,
    LATEST_FILE,
    WEIGHTS_FILE,
    WeightsPayload,
    engine_payload,
    publish_weights,
    read_files,
    version_dir,
    write_payload,
)

SMALL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 64}  # fmt: skip


def _model(seed: int = 0):
    return build_model(tiny_config(task_tokenizer().vocab_size, **SMALL), seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_payload_written_on_a_node_is_the_engine_facing_tensors_in_the_engines_dtype(tmp_path, dtype):
    model = _model(1)
    state = model.state_dict()
    payload = engine_payload(state, model.config, 7, dtype)
    assert "lm_head.weight" not in payload.names  # tied to the embedding: the engine aliases it
    path = write_payload(payload, tmp_path)
    assert path == version_dir(tmp_path, 7)
    assert (tmp_path / LATEST_FILE).read_text().strip() == "7"
    loaded = load_file(str(path / WEIGHTS_FILE))
    assert sorted(loaded) == sorted(payload.names)
    for name, tensor in loaded.items():
        assert tensor.dtype == getattr(torch, dtype), name
        assert torch.equal(tensor, state[name].to(getattr(torch, dtype))), name
    assert json.loads((path / "config.json").read_text())["hidden_size"] == SMALL["hidden_size"]
    assert payload.nbytes == sum(t.numel() * t.element_size() for t in loaded.values())
    if dtype == "bfloat16":  # half the bytes of the trainer's fp32 weights
        fp32 = engine_payload(state, model.config, 7, "float32")
        assert payload.nbytes * 2 == fp32.nbytes


def test_the_builtin_engine_loads_a_copy_written_from_a_payload(tmp_path):
    trained, engine_model = _model(1), _model(2)
    dtype = EngineSpec(backend="builtin").weights_dtype
    assert dtype == "float32" and EngineSpec(backend="vllm").weights_dtype == "bfloat16"
    path = write_payload(engine_payload(trained.state_dict(), trained.config, 3, dtype), tmp_path)

    async def update(engine: BuiltinEngine):
        await engine.pause()
        await engine.update_weights(3, str(path))
        await engine.resume()
        return await engine.stats()

    with BuiltinEngine(engine_model, max_batch=2) as engine:
        assert asyncio.run(update(engine)).version == 3
        for (name, p), q in zip(engine.model.state_dict().items(), trained.state_dict().values(), strict=True):
            assert torch.equal(p, q), name


def test_a_bad_dtype_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        engine_payload(model.state_dict(), model.config, 1, "int8")


def _payload(version: int) -> WeightsPayload:
    model = _model(version)
    return engine_payload(model.state_dict(), model.config, version, "float32")


def test_a_worker_keeps_the_newest_copies_and_the_one_its_engine_holds(tmp_path):
    worker = ResourceWorker(WorkerSpec("T00", ("train",), (), "unused", weights_local_root=str(tmp_path)))
    try:
        for v in range(1, 7):
            result = worker.stage_weights(v, _payload(v), [2])  # the engine still holds version 2
            assert result.version == v
            assert result.path == str(version_dir(worker.local_root(), v))
            assert Path(result.path, WEIGHTS_FILE).is_file()
        newest = list(range(7 - KEEP_LATEST_VERSIONS, 7))
        assert worker.staged_versions() == [2, *newest]
        on_disk = sorted(int(p.name[1:]) for p in worker.local_root().glob("v*"))
        assert on_disk == [2, *newest]
        worker.stage_weights(7, _payload(7), [6])  # the engine moved on: version 2 goes
        assert worker.staged_versions() == list(range(8 - KEEP_LATEST_VERSIONS, 8))
        with pytest.raises(ValueError, match="version 8 is not 9"):
            worker.stage_weights(9, _payload(8))
        root = worker.local_root()
        assert root.parent == tmp_path and root.name.startswith("seamlessflow-weights-T00-")
    finally:
        worker.close()
    assert not root.exists()  # a closed worker leaves nothing on its node


def test_a_worker_handed_the_initial_weights_starts_its_trainer_from_its_own_copy(tmp_path):
    model, tok = _model(4), task_tokenizer()
    shipped = publish_weights(model.state_dict(), model.config, tmp_path / "driver", 0, tok).path
    files = read_files(shipped)
    spec = WorkerSpec("T00", ("train",), (), "/not/on/this/node", weights_local_root=str(tmp_path / "node"))
    worker = ResourceWorker(spec, files)
    try:
        local = Path(worker.model_dir())
        assert local.parent == worker.local_root() and local.name == "initial"
        assert sorted(p.name for p in local.iterdir()) == sorted(files)
        assert worker.init_trainer(0, 1, "", {"kl_coef": 0.01}, str(tmp_path / "checkpoints"), None) == 0
        for (name, p), q in zip(worker.trainer.model.state_dict().items(), model.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
        assert load_checkpoint(local)[1].vocab_size == tok.vocab_size
    finally:
        worker.close()


def test_read_files_refuses_a_nested_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="holds directories"):
        read_files(tmp_path)


# ---- the transport, over workers in this process ----


class _Ref:
    """What an object ref stands for: a value that other calls receive resolved (weakly referenceable)."""

    def __init__(self, value) -> None:
        self.value = value


class _Workers(LocalWorkers):
    """In-process workers whose split calls hand on a `_Ref` (as Ray hands on an object ref), which reaches a method
    as its value; a method of `fail` raises instead."""

    def __init__(self, workers: dict, fail: set[str] = frozenset()) -> None:
        super().__init__(workers)
        self.fail = fail

    async def _run(self, resource, method, *args):
        if method.__name__ in self.fail:
            raise RuntimeError(f"{method.__name__} failed on {resource}")
        return await super().call(resource, method, *(a.value if isinstance(a, _Ref) else a for a in args))

    def call(self, resource, method, *args):
        return self._run(resource, method, *args)

    def call_split(self, resource, method, *args):
        meta, payload = super().call_split(resource, method, *args)
        self.last_payload = weakref.ref(ref := _Ref(payload))
        return meta, ref


class _Trainer:
    """A trainer worker's `publish_payload`: version `n` on its n-th call."""

    def __init__(self) -> None:
        self.version = 0

    def publish_payload(self, dtype: str):
        self.version += 1
        p = _payload(self.version)
        return WeightsCopy(p.version, None, 0.0, p.nbytes), p


def _engine_worker(root: Path, name: str) -> ResourceWorker:
    return ResourceWorker(WorkerSpec(name, ("train",), (), "unused", weights_local_root=str(root / name)))


def test_each_engine_loads_its_own_copy_and_the_payload_is_released_once_copied(tmp_path):
    engines = {n: _engine_worker(tmp_path, n) for n in ("R00", "R01")}
    workers = _Workers({"T00": _Trainer(), **engines})
    held = dict.fromkeys(engines, 0)
    initial = {n: f"/initial/{n}" for n in engines}

    async def run():
        transport = ObjectStoreTransport(workers, list(engines), "float32", initial, held.__getitem__)
        assert await transport.sources(0, ["R01"]) == {"R01": "/initial/R01"}
        paths = {}
        for version in (1, 2, 3, 4, 5):
            meta = await transport.publish(["T00"], version)
            assert meta.version == version
            assert meta.bytes > 0
            paths[version] = await transport.sources(version, list(engines))
            held.update(dict.fromkeys(engines, version))
        gc.collect()
        released = workers.last_payload() is None
        with pytest.raises(RuntimeError, match="version 1 is not on the engines' nodes"):
            await transport.sources(1, ["R00"])  # older than the versions kept
        await transport.close()
        return paths, released, transport

    try:
        paths, released, transport = asyncio.run(run())
        for version, by_engine in paths.items():
            assert by_engine == {n: str(version_dir(w.local_root(), version)) for n, w in engines.items()}
        assert released, "the executor still holds a payload every worker has copied"
        assert len(transport.stage_s) == 5 and transport.failure is None
        assert all(w.staged_versions() == [3, 4, 5] for w in engines.values())
    finally:
        for w in engines.values():
            w.close()


def test_a_copy_that_fails_stops_the_run(tmp_path):
    engines = {"R00": _engine_worker(tmp_path, "R00")}
    workers = _Workers({"T00": _Trainer(), **engines}, fail={"stage_weights"})

    async def run():
        transport = ObjectStoreTransport(workers, ["R00"], "float32", {"R00": "/i"}, lambda e: 0)
        await transport.publish(["T00"], 1)
        with pytest.raises(RuntimeError, match="stage_weights failed on R00"):
            await transport.sources(1, ["R00"])
        return transport

    try:
        transport = asyncio.run(run())
        assert "copying weights version 1" in str(transport.failure)
    finally:
        engines["R00"].close()


# ---- the manager: each engine from its own source ----


class _RecordingEngine(FakeEngine):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.sources: list[tuple[int, str | None]] = []

    async def update_weights(self, version: int, source: str | None = None) -> None:
        await super().update_weights(version, source)
        self.sources.append((version, source))


def test_the_manager_loads_each_engine_from_its_own_source(tok, tmp_path):
    from reference.manager.embedded import ManagerThread
    from reference.manager.manager import ManagerConfig

    engines = {f"e{i}": _RecordingEngine(vocab_size=tok.vocab_size) for i in range(2)}
    with ManagerThread(engines, tok, tmp_path / "store.sqlite", ManagerConfig()) as m:
        m.call(m.manager.pause())
        m.call(m.manager.update_weights(3, {"e0": "/node-a/v3", "e1": "/node-b/v3"}))
        assert engines["e0"].sources == [(3, "/node-a/v3")] and engines["e1"].sources == [(3, "/node-b/v3")]
        assert {s.name: s.weights_source for s in m.manager.router.slots} == {"e0": "/node-a/v3", "e1": "/node-b/v3"}
        m.call(m.manager.update_weights(4, {"e1": "/node-b/v4"}, ["e1"]))
        assert [s.version for s in m.manager.router.slots] == [3, 4]
        with pytest.raises(ValueError, match="no source directory for engines e0"):
            m.call(m.manager.update_weights(5, {"e1": "/node-b/v5"}))
        m.call(m.manager.update_weights(5, "/shared/v5"))  # one directory for all, as before
        assert engines["e0"].sources[-1] == (5, "/shared/v5") == engines["e1"].sources[-1]


def test_payload_buffers_are_plain_uint8_arrays():
    """What Ray stores without pickling the tensors: numpy buffers (zero-copy out of band)."""
    payload = _payload(1)
    assert all(isinstance(b, np.ndarray) and b.dtype == np.uint8 for b in payload.buffers)


# ---- a restarted engine comes back to its version from its worker's copy ----


def _greedy(url: str, token: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """A greedy generation's tokens and logprobs: what the engine's current weights say about one prompt."""
    from reference.engine.base import GenerateRequest, SamplingParams, generate
    from reference.engine.client import HTTPEngine

    async def run():
        engine = HTTPEngine(url, token=token)
        try:
            request = GenerateRequest("probe", (5, 6, 7), SamplingParams(max_tokens=6, temperature=0, seed=1))
            result = await generate(engine, request)
        finally:
            await engine.close()
        return result.token_ids, tuple(round(x, 4) for x in result.logprobs)

    return asyncio.run(run())


@pytest.mark.slow
def test_a_restarted_engine_reloads_its_version_from_its_own_copy(tok, tmp_path, wait_for):
    """The engine holds version 1 (from its worker's copy; newer copies were made since): killed, the supervisor
    restarts it through its worker (it starts from the initial weights, the worker's own copy of them) and reloads
    version 1 from the same copy."""
    import os
    import signal

    from reference.control.engines import WorkerEngine
    from reference.engine.client import HTTPEngine
    from reference.manager.embedded import ManagerThread
    from reference.manager.manager import ManagerConfig
    from reference.manager.supervisor import SupervisorConfig

    task_tok = task_tokenizer()
    initial = publish_weights(_model(0).state_dict(), _model(0).config, tmp_path / "driver", 0, task_tok).path
    spec = WorkerSpec("R00", ("rollout",), (), "/not/on/this/node", max_batch=2,
                      weights_local_root=str(tmp_path / "node"))  # fmt: skip
    worker = ResourceWorker(spec, read_files(initial))
    try:
        url, token = worker.engine_address()
        at_start = _greedy(url, token)
        copy = worker.stage_weights(1, _payload(1), [0]).path
        for v in (2, 3, 4, 5):  # newer versions arrive; the engine still holds 1
            worker.stage_weights(v, _payload(v), [1])
        assert Path(copy).is_dir()
        handle = WorkerEngine(LocalWorkers({"R00": worker}), "R00", url, worker.engine_pid(), local=True)
        fast = SupervisorConfig(interval_s=0.2, probe_timeout_s=2.0, restart_after_s=2.0)
        with ManagerThread({"R00": HTTPEngine(url, token=token)}, tok, tmp_path / "store.sqlite", ManagerConfig(),
                           processes={"R00": handle}, supervisor=fast) as m:  # fmt: skip
            m.call(m.manager.pause())
            m.call(m.manager.update_weights(1, {"R00": copy}))
            m.call(m.manager.resume())
            on_v1 = _greedy(worker.engine_address()[0], token)
            assert on_v1 != at_start  # version 1's weights differ from the initial ones
            os.kill(worker.engine_pid(), signal.SIGKILL)
            wait_for(lambda: handle.restarts >= 1, timeout_s=60, what="the supervisor's restart")
            slot = m.manager.router.slot("R00")
            wait_for(lambda: not slot.stale and slot.up(time.monotonic()), timeout_s=60,
                     what="the restarted engine brought back to its version")  # fmt: skip
            assert slot.version == 1 and slot.weights_source == copy
            assert _greedy(worker.engine_address()[0], token) == on_v1
    finally:
        worker.close()


def test_the_transport_is_a_run_setting_and_the_runs_own_initial_weights_are_shipped(tmp_path):
    from core.errors import UserError
    from reference.control.config import load_train_config
    from reference.control.layout import ships_initial_weights

    assert load_train_config(None, []).engine.weights_transport == "directory"  # today's behaviour by default
    with pytest.raises(UserError, match="weights_transport .nfs.; choose one of directory, object_store"):
        load_train_config(None, ["engine.weights_transport=nfs"])
    fresh = load_train_config(None, ["engine.weights_transport=object_store"])
    assert ships_initial_weights(fresh, str(tmp_path / "weights" / "v00000000"))
    assert not ships_initial_weights(load_train_config(None, []), str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    given = load_train_config(None, ["engine.weights_transport=object_store", f"model.dir={model}"])
    assert not ships_initial_weights(given, str(model))  # a checkpoint the user gave: read where it is
    assert ships_initial_weights(given, str(tmp_path / "warm-start"))  # weights the run wrote from it
