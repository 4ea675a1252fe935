"""Resumable trainer checkpoints: a run stopped after step K and resumed continues bit for bit.

A checkpoint directory holds the weights in the hand-off format (`model.safetensors`, `config.json`:
so it can also be served), `trainer_state.pt` (AdamW state, step, the trainer's Python and torch RNG
states, its config and pad id) and `trainer_config.json` (the same config, for people). It is written
atomically (temporary directory, then rename) by rank 0. Resuming rebuilds the model from the saved
config and weights (float32 safetensors: exact), restores AdamW's moments and step counts, the step
number and both RNG states, so the next step computes exactly what the uninterrupted run computed.
A frozen reference model is not saved: pass the same one again.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import Qwen3Config

from reference.model import build_model, load_weights
from reference.trainer.config import TrainerConfig
from reference.trainer.handoff import write_directory_atomically, write_weights
from reference.trainer.parallel import DataParallel

STATE_FILE = "trainer_state.pt"


def save_checkpoint(trainer, directory: str | Path) -> Path:
    """Write `trainer`'s full state to `directory` (every rank must call it; rank 0 writes)."""
    directory = Path(directory)
    weights = trainer.parallel.full_state_dict(trainer.model)
    optimizer = trainer.parallel.optimizer_state(trainer.model, trainer.optimizer)
    state = {
        "step": trainer.step,
        "pad_id": trainer.pad_id,
        "config": trainer.config.to_dict(),
        "optimizer": optimizer,
        "python_rng": trainer.rng.getstate(),
        "torch_rng": trainer.generator.get_state(),
    }

    def write(tmp: Path) -> None:
        write_weights(weights, trainer.model_config, tmp, metadata={"step": str(trainer.step)})
        torch.save(state, tmp / STATE_FILE)
        text = json.dumps({"step": trainer.step, **trainer.config.to_dict()}, indent=2)
        (tmp / "trainer_config.json").write_text(text + "\n", encoding="utf-8")

    if trainer.parallel.is_main:
        write_directory_atomically(directory, write)
    trainer.parallel.barrier()
    return directory


def load_checkpoint(
    cls,
    directory: str | Path,
    *,
    parallel: DataParallel | None = None,
    ref_model: torch.nn.Module | None = None,
    checkpoint_dir: str | Path | None = None,
):
    """A `cls` (Trainer) continuing the checkpointed run; `checkpoint_dir` defaults to the parent of
    `directory`, where the run wrote it."""
    directory = Path(directory)
    path = directory / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a trainer checkpoint: no {STATE_FILE}")
    state = torch.load(path, weights_only=True)
    model = build_model(Qwen3Config.from_json_file(str(directory / "config.json")))
    load_weights(model, directory)
    trainer = cls(
        model,
        TrainerConfig.from_dict(state["config"]),
        pad_id=state["pad_id"],
        ref_model=ref_model,
        parallel=parallel,
        checkpoint_dir=checkpoint_dir if checkpoint_dir is not None else directory.parent,
    )
    trainer.parallel.load_optimizer_state(trainer.model, trainer.optimizer, state["optimizer"])
    trainer.step = state["step"]
    trainer.rng.setstate(_as_rng_state(state["python_rng"]))
    trainer.generator.set_state(state["torch_rng"])
    return trainer


def _as_rng_state(state) -> tuple:
    """random.Random.setstate wants tuples; a round trip may hand back lists."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
