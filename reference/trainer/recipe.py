"""The math-training recipe: model size, batch shape and trainer settings in one validated record.

These defaults made GRPO learn the `math` task from a random start on a 2-core CPU in well under a
minute (see `reference.trainer.probe`): a 2-layer, 128-wide Qwen3 over the 22-token task vocabulary,
16 prompts x 16 samples a step at temperature 1, clip 0.2, gradient clip 1.0, AdamW at 8e-4, an
entropy bonus of 0.04, and advantages that are group-centred rewards not divided by the group's std.
`make train-math` and the probe both start from it.

Why (not `TrainerConfig`'s 3e-4, 0.01 and std normalisation): the failure that matters here is the
policy's entropy collapsing before its answers are right (every sample of a prompt then agrees, the
advantages are zero, learning stalls). Steps to a 5-step mean training reward of 0.8, measured with
the probe in the tag pipeline's worst case (`--lag 1`: every token one version stale), init seed 0:
3e-4 / 0.01: 319-365 (4 seeds); 6e-4 / 0.01: 179-397 (4; one collapsed early and crawled); 6e-4 /
0.03: 183-277 (8); 8e-4 / 0.04: 118-225 (10, 4 of them with other inits); 1e-3 / 0.05: 117-276 (8).
Clip-higher (`clip_eps_high` 0.28) did not help at 3e-4 or 6e-4. On the runtime (`make train-math`,
300 steps, seeds 0-4) 8e-4 / 0.04 still collapsed on seed 0 (0.8 only at step 487 of 500) and was
slow on seed 3 (235). Dividing by the group's std feeds that collapse: a group that almost
agrees (15 samples right, one wrong) gets advantages of several units, a hard push onto the majority;
without it (Dr. GRPO, Liu et al. 2025) the runtime reached 0.8 at steps 131-215 on all five seeds,
the probe at 128-153 (lag 1, 4 seeds) and 143-177 on-policy (lag 0, 4 seeds; 181-397 with the std).

The SWE recipe (`reference/configs/swe.yaml`, `make train-swe`; the warm start's measurements are in
`reference.trainer.swe_probe`). The same 1.0 M-parameter model over the project's chat tokenizer, a
supervised warm start on the 32 train demonstrations (300 steps of 4 episodes at lr 3e-3), then GRPO on
groups of 8 episodes of a task, 4 tasks a step, at temperature 1, no entropy bonus, no std division.

Why the warm start stops at 300 steps: the model memorises the demonstrations (loss 0.003 nats a generated
token), and an episode samples about 730 tokens, so it resolves a task only when every one of them stays on
the demonstrated path: pass@1 at temperature 1 is about exp(-730 x 0.003) = 0.1-0.2 (measured 0.16 and 0.18
over 4 episodes a task, 0.09-0.25 over one), leaving RL the room between that and 1. At 250 steps no sampled
fix turn resolves; at 400 steps half do.

Why overlong episodes are masked (`task.options.overlong: mask`): half the episodes of that policy leave the
path, wander, and end at the turn limit. Their hundreds of uncertain tokens carry most of the gradient's
norm (a token's log-probability gradient is 1 - p, about 0.003 on the path and 0.3-0.6 off it), so with
them in the loss a step is mostly noise that Adam scales to full size: pass@1 fell from 0.25 to 0.125 in five
steps at lr 5e-4 (one episode a task) and the sampled entropy rose 0.29 -> 0.36; in a fix-turn probe lr
3e-4 took pass@1 0.72 -> 0.30. Masked (their rewards still in the group's baseline, DAPO's overlong
filtering), the entropy fell 0.21 -> 0.14-0.18 over 8 steps at lr 1e-4.

Why evaluations run 4 episodes a task (`run.eval_samples`): one episode a task measured the same weights at
0.094, 0.22 and 0.25. With 4, the standard error over the 32 tasks is about 0.035.

Not yet shown: that GRPO raises pass@1. Measured from the same warm-started weights (4 episodes a task,
train split): lr 1e-4, 8 steps, overlong masked: 0.164 -> 0.164 (7 tasks up, 9 down). At that rate Adam
moves each weight by at most 8e-4 in 8 steps, against the warm start's 300 steps of 3e-3: the policy
barely moves. At lr 5e-4 (masked; start 0.18) the sampled entropy rose again, 0.16 -> 0.25 in four steps,
and the steps' training reward went 0.22, 0.09, 0.19, 0.03 (stopped there): too large a step for a memorised
policy even without the off-path tokens. The fix-turn probe then tried the space between (its module
docstring has the table): a learning-rate warm-up (`trainer.warmup_steps`), 5e-5 to 2e-4 for up to 30 steps,
every task in every step, training only on the better-than-mean episodes (`trainer.negative_weight` 0) and
continuing from the warm start's own AdamW moments. Small steps left pass@1 where it was; larger ones broke the
memorised policy, even when they only imitated its own successes. What to measure next: RL from a warm start
that has not memorised its demonstrations (stopped earlier, or on more tasks than it can memorise), where the
sampled episodes differ in more than a few tokens, and a KL anchor to the warm start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from transformers import Qwen3Config

from reference.model import tiny_config
from reference.trainer.config import TrainerConfig


@dataclass(frozen=True)
class MathRecipe:
    """What to train and how; every integer field must be >= 1."""

    task: str = "math"  # a name in reference.tasks.TASKS
    hidden_size: int = 128  # model width
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA); divides num_heads
    head_dim: int = 32  # per-head width
    intermediate_size: int = 512  # MLP width
    initializer_range: float = 0.02  # std of the random init (Qwen3's value; see the module docstring)
    prompts_per_step: int = 16  # GRPO groups per training step
    group_size: int = 16  # samples per prompt (temperature 1)
    trainer: TrainerConfig = field(
        default_factory=lambda: TrainerConfig(micro_batch_size=256, lr=8e-4, entropy_coef=0.04, normalize_std=False)
    )  # see the module docstring for why

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "prompts_per_step", "group_size"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MathRecipe.{name} must be an integer >= 1, got {value!r}")
        if not 0 < self.initializer_range <= 1:
            raise ValueError(f"MathRecipe.initializer_range must be in (0, 1], got {self.initializer_range!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO compares samples of a prompt), got {self.group_size}")

    @property
    def batch_size(self) -> int:
        """Sequences per training step."""
        return self.prompts_per_step * self.group_size

    def model_config(self, vocab_size: int, max_positions: int = 64) -> Qwen3Config:
        """The Qwen3 config of the recipe's model over a vocabulary of `vocab_size` ids."""
        return tiny_config(
            vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=max_positions,
            initializer_range=self.initializer_range,
        )

    def to_dict(self) -> dict:
        return asdict(self)
