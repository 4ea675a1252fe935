"""Supervised warm start: raise the likelihood of demonstrations' generated tokens (behaviour cloning).

A tiny model from a random start never solves a SWE task by chance, so GRPO would see reward 0 on every
episode and learn nothing. Before RL, `supervised_fit` trains the model on demonstration trajectories
recorded through the trajectory manager exactly as rollouts are (`swebench_env.scripted`: the agent's
prompts, the tool observations it really saw, the demonstration's replies as the generated tokens).
The loss is the mean negative log-likelihood of the generated tokens (the mask of `Trajectory`;
prompts and observations are context only), over the tokens of each step's sampled sequences. AdamW
with a linear warm-up (then a constant rate, or a cosine decay), gradient clipping, a seeded sampler: the
same records and seed give the same weights. How long to train is the recipe's choice
(`reference.trainer.recipe`): long enough that the policy sometimes succeeds, short enough that RL still has
room to improve it. `steps` bounds it; with `target_loss` set, the fit also stops at the first step where the
mean loss of the last `target_window` steps is at or below the target (how well it fits, not how long it ran,
decides where it stops: at a high learning rate the same number of steps ends at losses up to 1.6 times
apart on records that differ by a timing line in one observation).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from reference.trainer.batch import Trajectory, collate
from reference.trainer.config import linear_warmup

DECAYS = ("none", "cosine")


@dataclass(frozen=True)
class SupervisedConfig:
    steps: int = 200  # optimiser steps
    batch_size: int = 8  # sequences a step, drawn without replacement (a new permutation each epoch)
    micro_batch_size: int = 4  # sequences a forward pass
    lr: float = 1e-3
    warmup_steps: int = 10  # linear warm-up of the learning rate
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # global norm; 0: no clipping
    seed: int = 0
    decay: str = "none"  # after the warm-up: none (constant lr) or cosine (down to final_lr_ratio * lr at the end)
    final_lr_ratio: float = 0.0  # cosine: the last step's learning rate, as a share of lr
    target_loss: float | None = None  # stop once the mean loss of the last target_window steps is <= this
    target_window: int = 20  # steps the target's mean is over (the fit never stops before this many)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batch_size", "target_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"warm_start.{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"warm_start.lr must be a finite number > 0, got {self.lr!r}")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError("warm_start.warmup_steps, grad_clip and weight_decay must be >= 0")
        if self.decay not in DECAYS:
            raise ValueError(f"warm_start.decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if not (isinstance(self.final_lr_ratio, int | float) and 0 <= self.final_lr_ratio <= 1):
            raise ValueError(f"warm_start.final_lr_ratio must be a number in [0, 1], got {self.final_lr_ratio!r}")
        if self.target_loss is not None and not (
            isinstance(self.target_loss, int | float)
            and not isinstance(self.target_loss, bool)
            and math.isfinite(self.target_loss)
            and self.target_loss > 0
        ):
            raise ValueError(f"warm_start.target_loss must be a finite number > 0 or null, got {self.target_loss!r}")

    @classmethod
    def from_section(cls, section: dict) -> SupervisedConfig:
        """The run config's `warm_start` section's fitting settings (every key but `evaluate_before`)."""
        return cls(**{k: v for k, v in section.items() if k != "evaluate_before"})

    def reached_target(self, losses: Sequence[float]) -> bool:
        """Whether a fit whose steps so far had `losses` stops here: the mean of the last `target_window` is at
        or below `target_loss` (never before `target_window` steps; never without a target)."""
        if self.target_loss is None or len(losses) < self.target_window:
            return False
        return sum(losses[-self.target_window :]) / self.target_window <= self.target_loss

    def learning_rate(self, step: int) -> float:
        """The learning rate of step `step` (from 0): the linear warm-up, then constant or a cosine decay that
        reaches `final_lr_ratio * lr` at the last step."""
        lr = linear_warmup(self.lr, step, self.warmup_steps)
        if self.decay == "none" or step < self.warmup_steps:
            return lr
        span = max(1, self.steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.lr * (self.final_lr_ratio + (1 - self.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def supervised_fit(
    model: torch.nn.Module,
    trajectories: Sequence[Trajectory],
    config: SupervisedConfig,
    pad_id: int,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train `model` in place on `trajectories`' generated tokens; returns one record a step (loss in nats a
    token, tokens, seconds): `config.steps` of them, fewer where `config.target_loss` is reached first. `on_step`
    sees each record as it is made (a progress bar, a log)."""
    if not trajectories or not any(t.num_generated for t in trajectories):
        raise ValueError("supervised_fit needs trajectories with generated tokens")
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    order: list[int] = []
    records = []
    for step in range(config.steps):
        start = time.perf_counter()
        picked = []
        while len(picked) < min(config.batch_size, len(trajectories)):
            if not order:
                order = rng.sample(range(len(trajectories)), len(trajectories))
            picked.append(trajectories[order.pop()])
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate(step)
        loss, tokens = _step(model, optimizer, picked, config, pad_id)
        record = {"step": step + 1, "loss": loss, "tokens": tokens, "time_s": time.perf_counter() - start}
        records.append(record)
        if on_step is not None:
            on_step(record)
        if config.reached_target([r["loss"] for r in records[-config.target_window :]]):
            break
    model.eval()
    return records


def _step(model, optimizer, picked: Sequence[Trajectory], config: SupervisedConfig, pad_id: int) -> tuple[float, int]:
    """One optimiser step over `picked`: the gradient of the token-mean NLL, micro-batch by micro-batch."""
    picked = sorted(picked, key=lambda t: len(t.token_ids))  # similar lengths pad little
    total = sum(t.num_generated for t in picked)
    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for lo in range(0, len(picked), config.micro_batch_size):
        part = picked[lo : lo + config.micro_batch_size]
        batch = collate(part, [0.0] * len(part), pad_id)
        nll = sequence_nll(model, batch.input_ids, batch.attention_mask, batch.mask)
        (nll / max(1, total)).backward()
        loss_sum += float(nll.detach())
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return loss_sum / max(1, total), total


def sequence_nll(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, mask: torch.Tensor
) -> torch.Tensor:
    """The summed negative log-likelihood of the targets where `mask` [B, L-1] is 1 (a scalar). The vocabulary
    projection runs on those positions only (a third of an agent episode's tokens are generated)."""
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]  # [B, L-1, H]
    keep = mask > 0
    logits = model.lm_head(hidden[keep]).float()  # [N, V]
    return torch.nn.functional.cross_entropy(logits, input_ids[:, 1:][keep], reduction="sum")
