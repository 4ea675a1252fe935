"""A resource's trainer with a KL term gets its reference model: the run's initial weights, frozen."""

from __future__ import annotations

import random

import torch

from reference.control.worker import ResourceWorker, WorkerSpec
from reference.model import default_model, save_checkpoint
from reference.trainer.batch import Trajectory


def _batch(version: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for group in range(2):
        prompt = [rng.randrange(5, 200) for _ in range(4)]
        for _ in range(4):
            answer = [rng.randrange(5, 200) for _ in range(4)]
            out.append(Trajectory(prompt + answer, [0] * 4 + [1] * 4, [-1.0] * 4, [version] * 4, group, rng.random()))
    return out


def test_a_kl_term_trains_against_the_initial_weights_frozen(tmp_path):
    model, tok = default_model(seed=3)
    initial = save_checkpoint(model, tok, tmp_path / "initial")
    worker = ResourceWorker(WorkerSpec("T00", ("train",), (), str(initial)))
    config = {"kl_coef": 0.05, "entropy_coef": 0.0, "lr": 1e-3}
    assert worker.init_trainer(0, 1, "", config, str(tmp_path / "checkpoints"), None) == 0
    trainer = worker.trainer
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())
    before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    first = worker.train_step(_batch(0, 0))
    assert first.kl == 0.0  # the policy is still the reference
    second = worker.train_step(_batch(1, 1))
    assert second.kl > 0  # one update away from it
    after = trainer.ref_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the reference never moves


def test_without_a_kl_term_no_reference_is_loaded(tmp_path):
    model, tok = default_model(seed=3)
    worker = ResourceWorker(WorkerSpec("T00", ("train",), (), str(save_checkpoint(model, tok, tmp_path / "m"))))
    worker.init_trainer(0, 1, "", {"kl_coef": 0.0}, str(tmp_path / "checkpoints"), None)
    assert worker.trainer.ref_model is None
