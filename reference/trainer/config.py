"""The trainer's one config: loss, optimiser and checkpoint settings, validated on construction.

Defaults are the setup that made GRPO learn from a random start on a 2-core CPU (see the task
recipe in `reference.trainer.recipe`): clip 0.2, entropy bonus 0.01 (without it the policy collapses
to a deterministic one and every group's advantages become zero), AdamW at 3e-4, gradient clipping
at 1.0, group-centred advantages not divided by the group's std (`normalize_std` False, Dr. GRPO, Liu et al.
2025: divided by it, a group that almost agrees gets advantages of several units pushing it onto its majority;
every recipe of the runtime sets False, and only code that built a TrainerConfig without the field got the
default of True it had before 2026-11-29). The KL term is off by default (`kl_coef` 0), so no reference model is
needed. Log-probs are at `temperature` 1 unless set (the runtime sets the rollouts' temperature). The off-policy
correction is off (`off_policy` "behaviour"), and so are the token budget of micro-batches and the dropping of
groups without signal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

OFF_POLICY = ("behaviour", "tis", "decoupled")  # TrainerConfig.off_policy (see `reference.trainer.loss`)


@dataclass(frozen=True)
class TrainerConfig:
    """Every knob of `Trainer`; see the field comments for units and allowed values."""

    # Loss (see `reference.trainer.loss` for the exact formula).
    clip_eps: float = 0.2  # PPO clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]; in (0, 1)
    clip_eps_high: float | None = None  # the upper side ("clip-higher", DAPO); None: clip_eps; in (0, 1)
    ratio_cap: float = 3.0  # dual clip: a token's loss is at most ratio_cap * |advantage|; > 1 + clip_eps_high
    entropy_coef: float = 0.01  # weight of the entropy bonus (nats per token); >= 0
    kl_coef: float = 0.0  # weight of the k3 KL to a frozen reference model; >= 0 (> 0 needs one)
    normalize_std: bool = False  # divide group-centred rewards by the group's std (GRPO as written); False, the
    # default and the runtime's recipes' choice (train.yaml, swe.yaml, recipe.py): group-centred only (Dr. GRPO)
    std_eps: float = 1e-6  # added to the std before dividing; > 0
    negative_weight: float = 1.0  # scales negative advantages (0: train only on better-than-average samples); [0, 1]
    off_policy: str = "behaviour"  # what the PPO ratio is against and how the engine-trainer gap is corrected:
    # "behaviour" (the engine's log-probs, no correction), "tis" (the trainer's own log-probs recomputed before the
    # update, times the truncated importance weight min(pi_prox / pi_behaviour, tis_cap)) or "decoupled" (the same
    # ratio, times pi_prox / pi_behaviour, a token past tis_cap left out: AReaL); "tis" and "decoupled" cost one
    # more forward pass without gradient
    tis_cap: float = 2.0  # the cap on the importance weight pi_prox / pi_behaviour of "tis" and "decoupled"; >= 1
    temperature: float = 1.0  # every log-prob, entropy and KL is of softmax(logits / temperature): the engines'
    # sampling temperature, whose processed log-probs the behaviour log-probs are (the runtime sets it from
    # rollout.temperature); > 0, finite
    drop_zero_advantage_groups: bool = False  # leave the groups whose advantages are all 0 (all rewards equal) out
    # of the step: no forward or backward pass for them, and their tokens out of the token mean T (DAPO's dynamic
    # sampling, without resampling); they still count in `sequences` and `reward_mean`
    # Optimiser.
    lr: float = 3e-4  # AdamW learning rate, constant after the warm-up; > 0
    warmup_steps: int = 0  # linear learning-rate warm-up: step k (from 0) uses lr * min(1, (k + 1) / warmup_steps)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas, each in [0, 1)
    weight_decay: float = 0.01  # AdamW decoupled weight decay; >= 0
    adam_eps: float = 1e-8  # AdamW epsilon; > 0
    grad_clip: float = 1.0  # max global L2 norm of the gradient; 0 turns clipping off
    epochs: int = 1  # optimiser steps on each step's data (PPO's epochs: the later ones clipped against the same
    # log-probs as the first, the engine's or the proximal ones; one policy version a step whatever the count); >= 1
    # Batching and bookkeeping.
    micro_batch_size: int = 64  # sequences per forward/backward; >= 1 (does not change the result)
    micro_batch_tokens: int | None = 0  # > 0: micro-batches by padded tokens instead (rows x longest row <= this,
    # cut from the batch sorted by length; a sequence longer than this is a micro-batch of its own);
    # micro_batch_size is then not used; 0 or null: off (does not change the result)
    logit_chunk_tokens: int = 2048  # trained tokens projected onto the vocabulary at once: the loss holds one
    # chunk's [logit_chunk_tokens, vocab] logits, recomputed in the backward pass; >= 1 (does not change the result)
    checkpoint_every_steps: int = 0  # write a resumable checkpoint every this many steps; 0 = never
    seed: int = 0  # seeds the trainer's RNGs (prompt order, sampling in the probe)

    def __post_init__(self) -> None:
        for name in (
            "clip_eps",
            "ratio_cap",
            "entropy_coef",
            "kl_coef",
            "std_eps",
            "negative_weight",
            "lr",
            "weight_decay",
            "adam_eps",
            "grad_clip",
            "tis_cap",
            "temperature",
        ):
            value = getattr(self, name)
            _check(_is_real(value), name, value, "a finite number")
        object.__setattr__(self, "betas", tuple(self.betas))
        _check(0 < self.clip_eps < 1, "clip_eps", self.clip_eps, "in (0, 1)")
        if self.clip_eps_high is None:
            object.__setattr__(self, "clip_eps_high", self.clip_eps)
        high = self.clip_eps_high
        _check(
            isinstance(high, float | int) and not isinstance(high, bool) and 0 < high < 1,
            "clip_eps_high",
            high,
            "in (0, 1) or null",
        )
        _check(self.ratio_cap > 1 + high, "ratio_cap", self.ratio_cap, f"> 1 + clip_eps_high = {1 + high}")
        _check(self.entropy_coef >= 0, "entropy_coef", self.entropy_coef, ">= 0")
        _check(self.kl_coef >= 0, "kl_coef", self.kl_coef, ">= 0")
        _check(self.std_eps > 0, "std_eps", self.std_eps, "> 0")
        _check(0 <= self.negative_weight <= 1, "negative_weight", self.negative_weight, "in [0, 1]")
        _check(self.off_policy in OFF_POLICY, "off_policy", self.off_policy, f"one of {list(OFF_POLICY)}")
        _check(self.tis_cap >= 1, "tis_cap", self.tis_cap, ">= 1")
        _check(self.temperature > 0, "temperature", self.temperature, "> 0 (the engines' sampling temperature)")
        _check(
            isinstance(self.drop_zero_advantage_groups, bool),
            "drop_zero_advantage_groups",
            self.drop_zero_advantage_groups,
            "true or false",
        )
        _check(self.lr > 0, "lr", self.lr, "> 0")
        betas_ok = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        _check(betas_ok, "betas", self.betas, "two values in [0, 1)")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _check(self.adam_eps > 0, "adam_eps", self.adam_eps, "> 0")
        _check(self.grad_clip >= 0, "grad_clip", self.grad_clip, ">= 0 (0 turns clipping off)")
        _check(_is_int(self.micro_batch_size) and self.micro_batch_size >= 1, "micro_batch_size", self.micro_batch_size)
        _check(_is_int(self.epochs) and self.epochs >= 1, "epochs", self.epochs)
        if self.micro_batch_tokens is None:
            object.__setattr__(self, "micro_batch_tokens", 0)
        tokens_ok = _is_int(self.micro_batch_tokens) and self.micro_batch_tokens >= 0
        _check(tokens_ok, "micro_batch_tokens", self.micro_batch_tokens, "an integer >= 0 (0 or null: off)")
        _check(
            _is_int(self.logit_chunk_tokens) and self.logit_chunk_tokens >= 1,
            "logit_chunk_tokens",
            self.logit_chunk_tokens,
        )
        _check(
            _is_int(self.warmup_steps) and self.warmup_steps >= 0,
            "warmup_steps",
            self.warmup_steps,
            "an integer >= 0 (0: no warm-up)",
        )
        _check(
            _is_int(self.checkpoint_every_steps) and self.checkpoint_every_steps >= 0,
            "checkpoint_every_steps",
            self.checkpoint_every_steps,
            "an integer >= 0",
        )
        _check(_is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerConfig:
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown TrainerConfig field(s) {unknown}; allowed: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


def linear_warmup(lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate of step `step` (from 0) after a linear warm-up over `warmup_steps` steps (0: none)."""
    return lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else lr


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str = "an integer >= 1") -> None:
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"TrainerConfig.{name} must be {allowed}, got {value!r}")
