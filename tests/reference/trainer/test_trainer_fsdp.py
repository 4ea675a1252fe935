"""FSDP on CPU (gloo): two sharded ranks train like one process on the union batch; bf16 mixed precision
stays close to it while computing in bf16; activation checkpointing changes nothing but memory.

The batch, model and config are those of the plain data-parallel test (`test_trainer_distributed`).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reference.trainer.batch import shard_by_group
from reference.trainer.parallel import DataParallel, init_process_group
from reference.trainer.trainer import Trainer
from tests.reference.trainer.test_trainer_distributed import CONFIG, STEPS, model, union_batch

SETTINGS = {
    "fp32": {},
    "bf16": {"param_dtype": "bfloat16"},
    "bf16-ckpt": {"param_dtype": "bfloat16", "activation_checkpointing": True},
}


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo", f"file://{init_file}", rank, world_size)
    try:
        for name, settings in SETTINGS.items():
            parallel = DataParallel.from_process_group(fsdp=True, **settings)
            trainer = Trainer(model(), CONFIG, pad_id=0, parallel=parallel)
            shard = trainer.model.model.layers[0].mlp.up_proj.weight
            metrics = [trainer.train_step(shard_by_group(union_batch(s), rank, world_size)) for s in range(STEPS)]
            state = parallel.full_state_dict(trainer.model)
            if rank == 0:
                torch.save({"state": state, "metrics": [m.to_dict() for m in metrics], "local": shard.to_local().shape,
                            "dtype": str(shard.dtype)}, f"{out_dir}/{name}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in SETTINGS}


@pytest.fixture(scope="module")
def single():
    trainer = Trainer(model(), CONFIG, pad_id=0)
    metrics = [trainer.train_step(union_batch(s)) for s in range(STEPS)]
    return trainer.model.state_dict(), metrics


def test_two_fsdp_ranks_on_cpu_equal_one_process(runs, single):
    state, metrics = single
    got = runs["fp32"]
    full = state["model.layers.0.mlp.up_proj.weight"].shape
    assert got["local"] == (full[0] // 2, full[1])  # each rank holds half of the parameter (and its moments)
    assert got["dtype"] == "torch.float32"  # the sharded master weights
    for name, value in state.items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for m, want in zip(got["metrics"], metrics, strict=True):
        assert (m["tokens"], m["sequences"]) == (want.tokens, want.sequences)
        assert m["loss"] == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
        assert m["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-5)


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_masters(runs, single):
    state, metrics = single
    for name in ("bf16", "bf16-ckpt"):
        got = runs[name]
        assert got["dtype"] == "torch.float32"  # what the optimiser steps
        assert all(v.dtype == torch.float32 for v in got["state"].values())
        losses = [m["loss"] for m in got["metrics"]]
        assert losses != [m.loss for m in metrics]  # computed in bf16: not the fp32 numbers
        assert losses == pytest.approx([m.loss for m in metrics], rel=0.05, abs=1e-3)
        for key, value in state.items():  # two AdamW steps at lr 3e-4 from the same start: close, not equal
            torch.testing.assert_close(got["state"][key], value, rtol=0, atol=2e-3, msg=key)
    # Recomputing activations in the backward changes nothing the step computes.
    for key, value in runs["bf16"]["state"].items():
        torch.testing.assert_close(runs["bf16-ckpt"]["state"][key], value, rtol=0, atol=0, msg=key)
    assert [m["loss"] for m in runs["bf16-ckpt"]["metrics"]] == [m["loss"] for m in runs["bf16"]["metrics"]]


def test_activation_checkpointing_in_one_process_equals_without(single):
    state, metrics = single
    trainer = Trainer(model(), CONFIG, pad_id=0, parallel=DataParallel(activation_checkpointing=True))
    assert trainer.model.model.gradient_checkpointing
    got = [trainer.train_step(union_batch(s)) for s in range(STEPS)]
    for key, value in state.items():
        torch.testing.assert_close(trainer.model.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert [m.loss for m in got] == pytest.approx([m.loss for m in metrics], rel=1e-6)


def test_bad_parallel_settings_name_the_value():
    with pytest.raises(ValueError, match=r"unknown param_dtype 'fp8'; choose one of \['float32', 'bfloat16'\]"):
        DataParallel(param_dtype="fp8")
    with pytest.raises(ValueError, match="param_dtype 'bfloat16' needs fsdp"):
        DataParallel(param_dtype="bfloat16")
