"""SWE warm-start probe: supervised training on the suite's demonstrations, in one process, with a pass@1 proxy.

Plain torch + transformers + the project's tokenizer, engine, manager renderer and agent code; no Ray, no server
process. It answers how far a supervised warm start on the 32 train demonstrations takes a tiny Qwen3, how cheaply,
and whether RL then has room (`make train-swe` must show learning).

What it does, per command (`python -m reference.trainer.swe_probe COMMAND ...`):

- `record`: runs every step of the suite's demonstrations (train and held-out) in a fresh local checkout with
  `LocalRunner`, the runner the built-in agent uses under `--sandbox local`, and caches each step's exit code,
  output and timeout flag in a JSON file (default /tmp/swe_probe/outputs.json), with the step that first
  changes the checkout (the fix turn) and the diff it leaves. `demos.replay` is not used because it appends
  stderr after stdout, where the runner (and the Docker sandbox) interleave them as the agent sees them.
- `lengths`: renders each demonstration as the manager stores the built-in agent's episode (`render_episode`:
  the agent's system prompt, tools and problem statement, each assistant turn = the text the demonstration
  engine of `swebench_env.scripted` emits, each tool result = `agent.observation` of the recorded output, all
  through the manager's own `ChatRenderer` with its splicing of sampled turns) and prints token counts.
- `sft`: trains a tiny Qwen3 from random init on the train split's rendered episodes (cross-entropy on the
  generated tokens only) and every `--eval-every` steps prints (a) the proxy pass@1 on each split: for each
  task, `--samples` temperature-1 samples of the fix turn given the demonstration's history up to it, each
  parsed like the manager parses tool calls and its command run in a checkout of the task; a sample resolves
  when the checkout's diff equals the demonstration's, or else when the task's tests pass with it; (b) the
  teacher-forced argmax exact match of the fix turn and of all turns. `--save DIR` writes a checkpoint the
  engines load (`python -m reference serve --model DIR`).
- `rollout`: the real thing for a checkpoint: the built-in agent (`BashAgent`) through a trajectory manager
  (`ManagerThread`) and the built-in engine in this process, on local checkouts, graded by the task's tests
  (`swebench_env.rollout.run_rollout` with `--sandbox local`'s workspace and grader).
- `grpo`: GRPO on the fix turn alone from a checkpoint (the project's `Trainer`; reward = the proxy's verdict),
  to see whether RL moves the proxy from a warm start; `--carry-optimizer` continues from the AdamW state that
  `sft --save` writes beside the weights (optimizer.pt), `--kl-coef` anchors the policy to the starting weights.

    python -m reference.trainer.swe_probe record
    python -m reference.trainer.swe_probe sft --steps 300 --eval-every 50 --seed 0 --save /tmp/swe_probe/ckpt
    python -m reference.trainer.swe_probe rollout --model /tmp/swe_probe/ckpt --split train --samples 2
    python -m reference.trainer.swe_probe grpo --model /tmp/swe_probe/ckpt --steps 40 [--carry-optimizer]

Measured here (2 CPU cores shared with other jobs, so seconds vary 2-10x with the load; torch 2.13, 1 thread:
on a busy machine 2 threads spin against each other and were 4-7x slower):

Lengths. The 32 train episodes, as the manager stores them, are 2,013 tokens on average (max 2,629; the 9
held-out ones 1,903), 729 of them generated, in 8 assistant turns of 91 tokens on average. The fix turn (always
the 5th) is 164 tokens on average (max 391, a heredoc script) after a 1,502-token prompt. The system prompt with
the two tools is 509 tokens and the first request 720-850. The longest tool output is 1,704 characters, so the
agent's 8,000-character observation limit never cuts anything: lowering it would not shorten an episode, whose
length is the fixed preamble plus the agent's own turns (the repro script is written twice). A 4,096-token
context holds every episode with room for a detour. Generated tokens are 36% of an episode, so the vocabulary
projection runs on them only (`target_logits`).

SFT from random init, hidden 128, 2 layers, 4 query / 2 KV heads of 32, MLP 512 (1.02M parameters, init std
0.02), 4 episodes a step, AdamW lr 3e-3 after 20 linear warm-up steps then constant, no weight decay, gradient
clip 1.0. Proxy = temperature-1 fix turns, 2 samples a task; argmax = teacher-forced exact match of the turn.

    step (epochs)   loss    argmax fix / all turns   proxy train   proxy held-out
    50 (6)          1.53    0.00 / 0.00              0.00          0.00
    100 (12.5)      0.69    0.00 / 0.34              0.00          0.00     seed 1: 0.62, 0.00 / 0.36, 0.00
    150 (19)        0.23    0.00 / 0.43              0.00          0.00
    200 (25)        0.10    0.22 / 0.61              0.00          0.00     seed 1: 0.09, 0.25 / 0.64, 0.00
    250 (31)        0.018   0.84 / 0.96              0.08          0.00
    300 (37.5)      0.004   0.97 / 1.00              0.36          0.00     seed 1: 0.006, 1.00 / 0.99, 0.25
    350 (44)        0.003   1.00 / 1.00              0.47          0.00
    400 (50)        0.002   1.00 / 1.00              0.50          0.00     seed 1: 0.002, 1.00 / 1.00, 0.59

Seconds: a step (about 8,000 tokens forward and backward) took 1.2-1.5 s when the machine was quiet and 3-13 s
when it was not; the 400 steps of seed 0 took 2,267 s of training under load (about 10 minutes at the quiet
rate). A proxy evaluation of the 41 tasks takes 1-4 minutes (longer for a poor model, whose fix turns run to the
512-token limit). Held-out tasks are never solved: their fix needs understanding of unseen code; the warm start
memorises the train split, which is what the target (train pass@1) asks for.

Two findings shape the recipe. (1) Sampling lags argmax badly: from step 350 the argmax of every turn of every
train episode is the demonstration's, yet a temperature-1 fix turn resolves only half the time (the tails of
~160 sampled tokens). The agent samples at temperature 1, so pass@1 is set by those tails, and RL has room even
on a memorised split. (2) The proxy tracks the real thing: the step-400 checkpoint of seed 0 resolved 16 of 32
train tasks with the real built-in agent, manager and engine (`rollout`, 1 episode a task, max_turns 12: 20
submitted, 12 hit the turn limit, the diff is graded either way), real pass@1 0.50, against proxy evaluations of
0.50, 0.72 (2 samples a task, other seeds) and 0.59 (4 samples a task): with 32 tasks the proxy's noise is about
+-0.1 at 2 samples a task; use 4 or more. Those 32 real episodes took about 2 minutes (concurrency 4, one engine
thread), about 4 s of wall time an episode.

GRPO on the fix turn alone (`grpo`, from the seed-0 step-400 checkpoint, 4 tasks x 8 samples a step, the
project's `Trainer`, token-mean clipped loss, no std normalisation, no entropy bonus): at lr 3e-4 the policy got
worse, proxy 0.72 -> 0.30 in 10 steps while the sampled entropy rose 0.12 -> 0.36 (Adam's first steps are full
size whatever the gradient's noise, and a memorised model has nowhere safe to go). At lr 3e-5 nothing moved:
proxy 0.59 -> 0.59 (4 samples a task) after 10 steps, entropy 0.12-0.21 throughout. A step took 60-240 s here
(32 samples up to 512 tokens, judged in checkouts, then trained).

The optimiser, measured the same way from SFT-300 checkpoints of seed 0 (proxy 0.35-0.39; a step's batch pass
rate, its first 0.31, is a second estimate), no weight decay, 4 samples a task in each evaluation (noise about
+-0.04). A step's gradient is tiny (global norm 0.002-0.28) and comes from a few tasks' tokens, and a fresh
Adam moves every weight by about the learning rate on its first steps whatever that gradient's size:

    setting (4 tasks x 8 samples a step unless noted)          proxy train at the steps in brackets
    fresh AdamW 2e-4, 6 warm-up steps (--grpo-warmup 6)        0.39 -> 0.31, 0.41, 0.29 (4, 8, 12)
    fresh AdamW 5e-5, 5 warm-up steps                          0.35 -> 0.34, 0.39, 0.26 (10, 20, 30)
    fresh AdamW 1e-4, 5 warm-up steps                          0.35 -> 0.34, 0.34 (10, 20)
    fresh AdamW 5e-4, 3 warm-up, positive advantages only      0.39 -> 0.19 (4); argmax fix 0.94 -> 0.78
      (--negative-weight 0: only better-than-mean samples)
    the SFT's AdamW moments carried (--carry-optimizer), 3e-4  0.35 -> 0.35, 0.34 (4, 8)
      carried, 1e-3: positive only / GRPO                     0.34 / 0.31 (4)
      carried, 1e-2: positive only                            0.36, 0.37, 0.27, 0.0 (4, 8, 10, 20); entropy -> 1.07
      carried, 1e-2: GRPO                                     0.0 (4): collapsed, entropy 0.34 -> 0.72
      carried, 3e-2 negatives x 0.1 / 5e-2 positive only      0.09 / 0.02 (4): collapsed
    every task every step (32 x 4), fresh AdamW 2e-4, 3 warm-up
      GRPO                                                    0.35 -> 0.31, 0.31 (3, 6); steps 1-8 resolved
                                                              0.31, 0.24, 0.27, 0.37, 0.35, 0.30, 0.31, 0.32
      positive advantages only                                0.35 -> 0.31 (3); steps 1-5: 0.31, 0.31, 0.27,
                                                              0.31, 0.31

So in up to 30 steps nothing tried raised the proxy: small steps leave it where it is, larger ones (even when
they only imitate the policy's own successes) break the memorised policy. The argmax fix turn is right for
31 of 32 tasks throughout, so the room is in the sampled tails, which no setting above sharpened.

Temperature (`--temperature`). The tails are diffuse: the SFT-300 model's fix turn resolves 0.35 of the time at
temperature 1 but 0.91 at 0.7 and 0.95 at 0.5 (4 samples a task). At 0.7 the warm start's length sets the room:
after 200 steps 0.03 (argmax fix 0.22), after 250 steps 0.62 (argmax fix 0.84), after 300 steps 0.91. From the
SFT-250 model, sampling and evaluating at 0.7, fresh AdamW with 2 warm-up steps:

    setting                                                      proxy at the steps in brackets
    GRPO 1e-3, 4 tasks x 8                                       0.62 -> 0.21 (4); entropy 0.33 -> 1.16
    GRPO 3e-4, 4 tasks x 8                                       0.62 -> 0.55 (4); argmax fix 0.84 -> 0.69
    GRPO 3e-4, 8 tasks x 4, the same 8 tasks every step          0.83 -> 0.73, 0.66 (4, 8); entropy 0.25 -> 0.50
    GRPO 1e-4, the same                                          0.83 -> 0.83, 0.75 (4, 8)
    GRPO 3e-4, 4 chosen tasks (0.38-0.5 each) x 8 every step     0.48 -> 0.62, 0.62, 0.52 (2, 4, 6)
    SGD lr 2, the same                                           0.48 -> 0.56, 0.56, 0.28 (2, 4, 6)
    positive advantages only (--negative-weight 0), 3e-4, the    0.48 -> 0.78, 0.81, 0.86 (2, 4, 6);
      same 4 tasks x 8 every step                                entropy 0.33 -> 0.14
    positive only, 3e-4, 4 of the 32 tasks x 8 a step            0.62 -> 0.64, 0.62 (4, 8)
    positive only, 3e-4, 8 of the 32 tasks x 4 a step            0.62 -> 0.66 (4)

So at temperature 0.7, training only on the better-than-mean samples sharpens the policy onto the paths that
resolve (entropy falls, pass@1 rises by 0.3-0.4 within 4-6 visits of a task), while the negative samples'
off-path tokens (a failed fix turn runs on to the 512-token limit) are what broke every GRPO run above. The
gain is per task: a task must be visited several times, so the recipe takes 8 tasks a step.

Not measured (time): other model sizes (hidden 256 x 4 layers costs about 2.3x the 1.0M model a step), other
batch sizes beyond a first try (8 episodes at lr 2e-3: loss 2.05 after 10 epochs, abandoned), a third seed, a
KL anchor to the warm start (`--kl-coef`), positive-only RL at temperature 0.7 for more than 8 steps.

What `make train-swe` takes from this (`reference/configs/swe.yaml`, reasons in `reference.trainer.recipe`): the
1.0M model, context 4,096; a warm start of 250 steps of 4 episodes at lr 3e-3 (20 warm-up steps); rollouts and
evaluations at temperature 0.7; max_tokens 512 (the longest demonstrated turn is 391), max_turns 10 (the
demonstrations take 8; the fix is the 5th); RL on 8 tasks x 4 episodes a step (the split in shuffled passes),
AdamW 3e-4 after 2 warm-up steps, two epochs a step, positive advantages only, no entropy bonus. Measured on
the runtime (8 steps, 2 evaluation episodes a task): train pass@1 0.469 -> 0.750 (seed 0), 0.438 -> 0.734
(seed 1), 0.422 -> 0.641 (seed 2), an earlier seed-1 run 0.312 -> 0.438; docs/swe.md
("Training on SWE tasks") has every run.

The demonstrations' recordings and rendered episodes are `swe_probe_data.py`'s, the proxy `swe_probe_proxy.py`'s.

Sampled commands run on this machine with no isolation, as `--sandbox local` rollouts do: trusted models only.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from reference.engine.builtin import BuiltinEngine
from reference.model import build_model, load_checkpoint, save_checkpoint, tiny_config
from reference.tokenizer import Tokenizer, default_tokenizer
from reference.trainer.swe_probe_data import Data, RenderedEpisode, load_data
from reference.trainer.swe_probe_proxy import (
    FIX_MAX_TOKENS,
    FixJudge,
    bash_command,
    fix_prompt,
    proxy_pass_at_1,
    sample_completions,
)
from swebench_env.agent import AgentConfig
from swebench_env.tasks import Instance

DEFAULT_DIR = Path(tempfile.gettempdir()) / "swe_probe"
OPTIMIZER_FILE = "optimizer.pt"  # `sft --save DIR` writes the AdamW state here


# ---- the model and supervised training ----


@dataclass(frozen=True)
class ModelDims:
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 512
    max_positions: int = 4096  # the longest rendered train episode is 2,599 tokens

    def config(self, vocab_size: int):
        return tiny_config(
            vocab_size,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate,
            max_position_embeddings=self.max_positions,
            initializer_range=0.02,
        )


def _padded(episodes: Sequence[RenderedEpisode], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, L], generated mask [B, L]), right-padded (causal attention: padding is never attended to)."""
    width = max(len(e.token_ids) for e in episodes)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(episodes), width), dtype=torch.bool)
    for i, e in enumerate(episodes):
        ids[i, : len(e.token_ids)] = torch.tensor(e.token_ids)
        mask[i, : len(e.token_ids)] = torch.tensor(e.generated_mask, dtype=torch.bool)
    return ids, mask


def target_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N, V] predicting each generated token, those tokens [N]); the vocabulary projection runs on the
    N generated positions only (a third of an episode), not on every position."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # [B, L-1, H]
    targets = mask[:, 1:]
    return model.lm_head(hidden[targets]).float(), ids[:, 1:][targets]


def sft_step(model, optimizer, episodes: Sequence[RenderedEpisode], pad_id: int, grad_clip: float = 1.0) -> float:
    """One AdamW step of token-mean cross-entropy on the generated tokens of `episodes`; the loss."""
    ids, mask = _padded(episodes, pad_id)
    logits, targets = target_logits(model, ids, mask)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def turn_exact_match(model, episodes: Sequence[RenderedEpisode], pad_id: int) -> tuple[float, float]:
    """(share of fix turns, share of all turns) whose every token is the teacher-forced argmax."""
    fix = every = turns = 0
    for e in episodes:
        ids, mask = _padded([e], pad_id)
        logits = model(input_ids=ids).logits[0, :-1]
        right = (logits.argmax(-1) == ids[0, 1:]).tolist()
        for k, (start, end) in enumerate(e.turns):
            ok = all(right[start - 1 : end - 1])
            every, turns = every + ok, turns + 1
            fix += ok and k == e.fix_turn
    return fix / len(episodes), every / turns


# ---- the runs ----


def evaluate(
    model, tok: Tokenizer, data: Data, judge: FixJudge, samples: int, seed: int, temperature: float = 1.0
) -> dict:
    """The proxy pass@1 of each split and the teacher-forced exact match of the fix turn / all turns (train)."""
    was_training = model.training
    model.eval()
    train = proxy_pass_at_1(model, tok, data.train, judge, samples, seed, temperature)
    held = (
        proxy_pass_at_1(model, tok, data.held_out, judge, samples, seed, temperature) if data.held_out else float("nan")
    )
    fix_em, turn_em = turn_exact_match(model, [e for *_, e in data.train], tok.pad_token_id)
    model.train(was_training)
    return {"proxy_train": train, "proxy_held_out": held, "fix_exact": fix_em, "turn_exact": turn_em}


def run_sft(
    dims: ModelDims,
    data: Data,
    tok: Tokenizer,
    *,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    seed: int,
    eval_every: int,
    samples: int,
    judge: FixJudge,
    temperature: float = 1.0,
    log: Callable[[str], None] = print,
):
    """SFT from a random init (seeded by `seed`) on the train episodes; returns (model, the AdamW state, eval log)."""
    model = build_model(dims.config(tok.vocab_size), seed=seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup)))
    rng, episodes = random.Random(seed), [e for *_, e in data.train]
    params = sum(p.numel() for p in model.parameters())
    generated, tokens = sum(sum(e.generated_mask) for e in episodes), sum(len(e.token_ids) for e in episodes)
    log(
        f"model {dims} ({params / 1e6:.2f}M parameters); {len(episodes)} episodes, {generated} generated tokens "
        f"of {tokens}"
    )
    history, order, losses, start, train_s = [], [], [], time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        if len(order) < batch:
            order += rng.sample(episodes, len(episodes))  # epochs in a fresh order
        chosen, order = order[:batch], order[batch:]
        t0 = time.perf_counter()
        losses.append(sft_step(model, optimizer, chosen, tok.pad_token_id))
        schedule.step()
        train_s += time.perf_counter() - t0
        if step % 10 == 0:
            log(f"step {step} loss {sum(losses[-10:]) / 10:.3f} ({train_s:.0f} s)")
        if step % eval_every == 0 or step == steps:
            loss = sum(losses[-len(episodes) // batch :]) / (len(episodes) // batch)  # the last epoch's worth
            metrics = {
                "step": step,
                "epochs": step * batch / len(episodes),
                "loss": loss,
                "train_s": train_s,
                **evaluate(model, tok, data, judge, samples, seed + step, temperature),
            }
            metrics["wall_s"] = time.perf_counter() - start
            history.append(metrics)
            log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in metrics.items()}))
    return model, optimizer.state_dict(), history


def real_rollouts(
    model,
    tok: Tokenizer,
    tasks: Sequence[Instance],
    config: AgentConfig,
    *,
    samples: int = 1,
    concurrency: int = 4,
    seed: int = 0,
) -> list:
    """`samples` episodes of each task by the built-in agent through a trajectory manager and the built-in engine
    over a copy of `model`, in local checkouts, graded by the tasks' tests: `InstanceResult`s."""
    from reference.manager.embedded import ManagerThread
    from swebench_env.agent import BashAgent
    from swebench_env.rollout import SweRolloutConfig, run_rollout

    results = []
    with BuiltinEngine(copy.deepcopy(model), max_batch=32, seed=seed, tokenizer=tok) as engine:
        with ManagerThread({"probe": engine}, tok) as manager:
            for k in range(samples):
                rollout = SweRolloutConfig(manager.url, concurrency, run_id=f"probe-{seed}-{k}")
                results += run_rollout(tasks, BashAgent(config), rollout)
    return results


def run_fix_grpo(
    model,
    tok: Tokenizer,
    data: Data,
    judge: FixJudge,
    *,
    steps: int,
    tasks_per_step: int,
    group_size: int,
    trainer_config,
    eval_every: int,
    samples: int,
    moments: dict | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """GRPO on the fix turn alone (prompt = the demonstration's history up to it, reward = the proxy's verdict)
    with the project's `Trainer`, on-policy; the proxy is evaluated every `eval_every` steps. `moments`: an AdamW
    state (the SFT's) to continue from instead of a fresh optimiser. Samples and evaluations are at the trainer's
    `temperature` (whose log-probs they then carry)."""
    from reference.trainer.batch import Trajectory
    from reference.trainer.trainer import Trainer

    reference = copy.deepcopy(model) if trainer_config.kl_coef > 0 else None  # the KL's anchor: the start weights
    trainer = Trainer(model, trainer_config, pad_id=tok.pad_token_id, ref_model=reference)
    if moments is not None:
        trainer.adopt_optimizer_moments(moments)
    seed, temperature, history, start = trainer_config.seed, trainer_config.temperature, [], time.perf_counter()
    history.append({"step": 0, **evaluate(trainer.model, tok, data, judge, samples, seed, temperature)})
    log(json.dumps(history[-1]))
    while trainer.step < steps:
        items = trainer.rng.sample(data.train, tasks_per_step)
        prompts = [fix_prompt(e) for *_, e in items]
        groups = sample_completions(
            trainer.model,
            prompts,
            group_size,
            tok.stop_token_ids,
            FIX_MAX_TOKENS,
            seed * 7919 + trainer.step,
            temperature=temperature,
        )
        batch = []
        for (task, recording, _), prompt, group in zip(items, prompts, groups, strict=True):
            for r in group:
                reward = float(judge(task, recording, bash_command(tok.decode(r.token_ids))))
                mask = (0,) * len(prompt) + (1,) * len(r.token_ids)
                versions = (trainer.version,) * len(r.token_ids)
                batch.append(Trajectory((*prompt, *r.token_ids), mask, r.logprobs, versions, task.instance_id, reward))
        metrics = trainer.train_step(batch)
        line = {
            "step": trainer.step,
            "reward": metrics.reward_mean,
            "entropy": metrics.entropy,
            "wall_s": time.perf_counter() - start,
        }
        if trainer.step % eval_every == 0 or trainer.step == steps:
            line |= evaluate(trainer.model, tok, data, judge, samples, seed + 100_000 + trainer.step, temperature)
            history.append(line)
        log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}))
    return history


# ---- the command line ----


def _dims(args) -> ModelDims:
    return ModelDims(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
    )


def _lengths(data: Data) -> None:
    for name, items in (("train", data.train), ("held_out", data.held_out)):
        eps = [e for *_, e in items]
        turns = [end - start for e in eps for start, end in e.turns]
        fix = [e.turns[e.fix_turn][1] - e.turns[e.fix_turn][0] for e in eps]
        tokens = [len(e.token_ids) for e in eps]
        print(
            f"{name}: {len(eps)} episodes; tokens per episode mean {sum(tokens) / len(eps):.0f}, max {max(tokens)}; "
            f"generated per episode {sum(map(sum, (e.generated_mask for e in eps))) / len(eps):.0f}; "
            f"tokens per assistant turn mean {sum(turns) / len(turns):.0f}, max {max(turns)}; fix turn mean "
            f"{sum(fix) / len(fix):.0f}, max {max(fix)}; fix prompt mean "
            f"{sum(len(fix_prompt(e)) for e in eps) / len(eps):.0f}"
        )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("record", "lengths", "sft", "rollout", "grpo"))
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="recorded outputs and checkouts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--steps", type=int, default=400, help="SFT or GRPO steps")
    parser.add_argument("--batch", type=int, default=4, help="SFT: episodes a step")
    parser.add_argument("--lr", type=float, default=3e-3, help="SFT learning rate (after a linear warm-up)")
    parser.add_argument("--warmup", type=int, default=20, help="SFT warm-up steps")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--samples", type=int, default=2, help="sampled fix turns (or rollouts) per task")
    parser.add_argument("--save", type=Path, default=None, help="sft: write the model here")
    parser.add_argument("--model", type=Path, default=None, help="rollout, grpo: a checkpoint directory")
    parser.add_argument("--split", choices=("train", "held_out"), default="train", help="rollout: the tasks")
    parser.add_argument("--max-turns", type=int, default=12, help="rollout: the agent's turn limit")
    parser.add_argument("--tasks-per-step", type=int, default=4, help="grpo: tasks a step")
    parser.add_argument("--group-size", type=int, default=8, help="grpo: samples per task")
    parser.add_argument("--grpo-lr", type=float, default=3e-4)
    parser.add_argument("--grpo-warmup", type=int, default=0, help="grpo: linear learning-rate warm-up steps")
    parser.add_argument("--negative-weight", type=float, default=1.0, help="grpo: scales negative advantages")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="grpo: k3 KL to the starting weights")
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of the proxy, the fix-turn GRPO and the rollouts",
    )
    parser.add_argument(
        "--carry-optimizer",
        action="store_true",
        help="grpo: continue from the SFT's AdamW moments (--model DIR/optimizer.pt)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = default_tokenizer()
    data = load_data(tok, args.dir / "outputs.json")
    judge = FixJudge(args.dir / "checkouts")
    if args.command == "lengths":
        _lengths(data)
    elif args.command == "sft":
        model, moments, _ = run_sft(
            _dims(args),
            data,
            tok,
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            warmup=args.warmup,
            seed=args.seed,
            eval_every=args.eval_every,
            samples=args.samples,
            judge=judge,
            temperature=args.temperature,
        )
        if args.save is not None:
            save_checkpoint(model, tok, args.save)
            torch.save(moments, args.save / OPTIMIZER_FILE)
    elif args.command in ("rollout", "grpo"):
        if args.model is None:
            parser.error(f"{args.command} needs --model DIR (a checkpoint `sft --save` wrote)")
        model, tok = load_checkpoint(args.model)
        if args.command == "rollout":
            tasks = [t for t, *_ in (data.train if args.split == "train" else data.held_out)]
            config = AgentConfig(max_turns=args.max_turns, max_tokens=FIX_MAX_TOKENS, temperature=args.temperature)
            results = real_rollouts(model, tok, tasks, config, samples=args.samples, seed=args.seed)
            print(
                json.dumps(
                    {
                        "pass@1": sum(r.resolved for r in results) / len(results),
                        "exit_reasons": _counts(r.exit_reason for r in results),
                        "resolved": sorted({r.instance_id for r in results if r.resolved}),
                    }
                )
            )
        else:
            from reference.trainer.config import TrainerConfig

            config = TrainerConfig(
                lr=args.grpo_lr,
                entropy_coef=0.0,
                normalize_std=False,
                micro_batch_size=8,
                seed=args.seed,
                warmup_steps=args.grpo_warmup,
                weight_decay=0.0,
                negative_weight=args.negative_weight,
                kl_coef=args.kl_coef,
                temperature=args.temperature,
            )
            moments = None
            if args.carry_optimizer:
                if not (args.model / OPTIMIZER_FILE).is_file():
                    parser.error(f"--carry-optimizer: {args.model / OPTIMIZER_FILE} is missing (sft --save writes it)")
                moments = torch.load(args.model / OPTIMIZER_FILE)
            run_fix_grpo(
                model.train(),
                tok,
                data,
                judge,
                steps=args.steps,
                tasks_per_step=args.tasks_per_step,
                group_size=args.group_size,
                trainer_config=config,
                eval_every=args.eval_every,
                samples=args.samples,
                moments=moments,
            )


def _counts(values) -> dict:
    counts: dict = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


if __name__ == "__main__":
    main()
