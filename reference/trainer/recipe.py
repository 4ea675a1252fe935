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

The SWE recipe (`reference/configs/swe.yaml`, `make train-swe`; the measurements behind it are in
`reference.trainer.swe_probe`'s docstring). The same 1.0 M-parameter model over the project's chat tokenizer, a
supervised warm start on the 32 train demonstrations (4 episodes a step at lr 3e-3, until the mean loss of the
last 20 steps reaches 0.02: about 250 steps), then 12 steps of GRPO on groups
of 4 episodes of a task, 8 tasks a step (the split in shuffled passes), at temperature 0.7, AdamW 3e-4 after 2
warm-up steps, two optimiser steps on each step's data (`epochs` 2), advantages of the better-than-mean
episodes only (`negative_weight` 0), no entropy bonus, no std division; the engines record the temperature-1
model's log-probs and the trainer scores at temperature 1 (`engine.logprobs_mode: raw`): every run measured for
this recipe did, and scoring at the rollouts' 0.7 instead (`processed`, the runtime's default) gave -0.109 and
+0.156 on two seeds (docs/swe.md).

Why temperature 0.7 (rollouts and evaluations alike): the warm start memorises the demonstrations, and what
fails a sampled episode is its tails, spread thinly over the ~730 tokens it generates. At temperature 1 a
300-step warm start's fix turn resolves 0.35 of the time and whole episodes 0.06-0.18; at 0.7 the same fix
turn resolves 0.91. RL at temperature 1 had to sharpen those diffuse tails, and no setting tried did (below).

Why the warm start stops about 250 steps in: pass@1 at 0.7 climbs steeply with its length (fix-turn proxy 0.03 after
200 steps, 0.62 after 250, 0.91 after 300; whole episodes 0.52 after 250), so 250 leaves RL room. Where it
lands varies run to run (train pass@1 0.11-0.59): the fit is deterministic given its records, but at lr 3e-3 it
is chaotic, and the records differ between runs by pytest's timing line; the landing follows the last steps'
loss (0.018 -> 0.47-0.59, 0.028 -> 0.11). A cosine decay to 0 over the same steps underfits (0.086 against
0.024 over all demonstrations). RL gains from a low landing too (0.11 -> 0.31). So the warm start now stops at a
loss, not a step count (`warm_start.target_loss: 0.02`, at most 400 steps): it stopped at 245-252 steps and
landed at 0.469 in each run measured so far, where RL had gained the most (from 0.42-0.47: +0.22 to +0.30 in
four runs of five), and 12 RL steps instead of 8 (the 8-step runs took 24 minutes of the 30).

mini-swe-agent (`swe-mini.yaml` over this recipe, `make train-swe AGENT=mini-swe-agent`): its SWE-bench prompts
make episodes twice as long and each reply must hold one well-formed tool call (three bad ones in a row end the
episode). Its warm start lands far more steeply with its length: train pass@1 0.08 after 250 steps (loss over the
last 20 steps 0.046; most episodes ended on malformed calls), 0.98 after 400 (0.002), no room for RL. 280 steps
(0.019 in that run, the built-in agent's 250-step loss) is its recipe (`swe-mini.yaml`: a fixed count and 8 GRPO
steps, as measured).

Why only the better-than-mean episodes: a failed episode leaves the demonstrated path and its later tokens are
uncertain (a token's log-probability gradient is 1 - p, about 0.003 on the path and 0.3-0.6 off it), so with
negative advantages a step is mostly the noise of those tokens, which Adam scales to full size: in the
fix-turn probe every GRPO setting from 1e-4 up lowered pass@1 or left it flat while the entropy rose, at 0.7 as
at 1. Trained only on its own successes (advantage 1 - the group's mean; a group that all resolves or all fails
trains nothing) the policy sharpens onto the paths that resolve: the probe's fix turn went 0.48 -> 0.78 -> 0.86
in 2 and 6 visits of a task, the entropy 0.33 -> 0.14. This is GRPO restricted to its positive half
(rejection-sampling fine-tuning with GRPO's group baseline as the weight); the group baseline still counts
every episode, overlong ones included.

Why 8 tasks a step: the gain is per task (each task's fix is its own memorised text). With 4 of the 32 tasks a
step, each visited about once in 8 steps, the probe's pass@1 stayed flat (0.62 -> 0.62); the same 4 tasks every
step gained 0.3-0.4. 8 tasks x 4 episodes keeps a step's 32 episodes and visits a task every 4 steps. The tasks
come in shuffled passes over the split (`SweTask.sample_train`): drawn with replacement, a seed-0 run visited
some tasks 4-5 times in 8 steps and 5 of the 32 never, and a task never visited cannot gain.

Why two epochs (`trainer.epochs: 2`): a step's rollout costs about two minutes here and its training a quarter
of that, so the data is worth a second optimiser step; the second pass trains only the rewarded episodes (the
others have advantage 0 and no gradient), clipped against the same behaviour log-probabilities (PPO's epochs),
and the probe's gains came from repeated updates on a task's successes.

Why overlong episodes are masked (`task.options.overlong: mask`): an episode cut off at the turn limit has
wandered; its rewards still count in its group's baseline (DAPO's overlong filtering), its tokens are not
trained. With negative advantages they dominated the step's gradient (pass@1 0.25 -> 0.125 in five steps at
temperature 1, lr 5e-4, the entropy 0.29 -> 0.36).

Why evaluations run 2 episodes a task (`run.eval_samples`), before and after RL only: one episode a task measured
the same weights at 0.094, 0.22 and 0.25; with 2 the standard error over the 32 tasks is about 0.06 (4: about
0.035-0.045), and an evaluation is 82 episodes (about 6 minutes on 2 cores) instead of 164. Each evaluation
episode's sampling seed is fixed by the run's seed, its task and its index (common random numbers,
`EpisodeContext.with_fixed_seeds`): the start and end evaluations draw the same numbers, so the same weights
would score the same and their difference is the weights' (with independent draws, that difference carried the
noise of both evaluations, about 0.085, as much as most gains). The held-out tasks
get one episode each (`run.held_out_samples: 1`): the tiny model never solves them, and their episodes are the
costliest (they run to the turn limit), so an evaluation is 73 episodes.

Measured (`make train-swe`, Docker, this 2-core machine): with the loss target and 12 GRPO steps train pass@1
went 0.469 -> 0.625 (seed 0, 22.0 minutes), 0.484 -> 0.641 (seed 1, 21.3) and 0.562 -> 0.734 (seed 2, 21.6).
Before it (a fixed 250-step warm start, 8 steps) 11 runs gained +0.05 to +0.30 from landings of 0.11-0.59, in
23.5-66 minutes. mini-swe-agent (seed 0, a fixed 280-step warm start): 0.359 -> 0.688 with 12 steps (27.7
minutes), 0.438 -> 0.578 and 0.438 -> 0.609 with 8. docs/swe.md has the runs' numbers
and wall times.
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
        for name in (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "prompts_per_step",
            "group_size",
        ):
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
