"""The runtime's GRPO trainer, measured alone for `experiments.validate`, and its costs fitted in the
simulator's terms.

Batches are drawn as the workload draws them (`draw_batch_lengths`; an agent's episode is one sequence), or
of one length each (`shape_lengths`, padded as a run's micro-batches are: `padded_lengths`), so attention,
which grows with the length, is told apart from the matmuls, which do not. `measure_trainer` times the
runtime's `Trainer.train_step` on one core, `measure_data_parallel` the same trainer on its data-parallel
layout (a gloo rank a core). `fit_trainer` turns the steps into the simulator's `train_mfu`,
`train_attention_mfu` and `train_step_overhead_s`; `fit_data_parallel` gives `train_dp_overhead_s`.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from experiments.runtime_parts import Grid

# The trainer's batches of one sequence length each (give or take a token: `padded_lengths`), as fractions of the
# model's context: at one token count, a step's matmuls stay the same across them while its attention grows with
# the length, which the workload's batches (whose lengths all follow one distribution) cannot tell apart.
TRAIN_SHAPES = (1 / 16, 1 / 4, 3 / 4)


def draw_batch_lengths(task, sequences: int, group_size: int, rng: random.Random) -> list[tuple[int, int]]:
    """(prompt, response) tokens of `sequences` samples drawn as the workload draws them: groups of
    `group_size` share a prompt and (the throughput task forces it) a response length. An agent's episode
    (workload kind `swe`) is one sequence, as the trainer gets it: its context (prompt and tool outputs) and the
    tokens its turns generated, drawn as the simulator draws them (`sim.workload`)."""
    from sim.config import Dist
    from sim.workload import draw_int

    w = task.simulator_workload()
    if w.get("kind") == "swe":
        return [(n - g, g) for n, g in swe_episode_lengths(w, sequences, group_size, rng)]
    prompt, response = Dist(**w["prompt_tokens"]), Dist(**w["response_tokens"])
    out: list[tuple[int, int]] = []
    while len(out) < sequences:
        p, r = draw_int(prompt, rng), draw_int(response, rng)
        out += [(p, r)] * min(group_size, sequences - len(out))
    return out


def swe_episode_lengths(workload: dict, sequences: int, group_size: int, rng: random.Random) -> list[tuple[int, int]]:
    """(tokens, generated tokens) of `sequences` agent episodes drawn from a `swe` workload's keys by the
    simulator's own `sim.workload.Workload` (groups of `group_size`; its seed from `rng`)."""
    from core import config as cfgio
    from sim.config import DEFAULT_CONFIG, WorkloadConfig
    from sim.workload import Workload

    keys = {k: v for k, v in workload.items() if k in WorkloadConfig.__dataclass_fields__}
    merged = {**cfgio.load_yaml(DEFAULT_CONFIG)["workload"], **keys, "group_size": group_size, "prompts_per_step": 1}
    draw = Workload(cfgio.from_dict(WorkloadConfig, merged), rng.randrange(1 << 30))
    out: list[tuple[int, int]] = []
    while len(out) < sequences:
        out += [(s.total_tokens, s.generated_tokens) for s in draw.new_group()][: sequences - len(out)]
    return out


def workload_batch(model_config, task, n: int, group_size: int, rng: random.Random) -> list:
    """`n` trajectories of random tokens with the workload's lengths (groups of `group_size` sharing a prompt
    length and a response length), random log-probs and rewards, policy version 0."""
    return random_batch(model_config, draw_batch_lengths(task, n, group_size, rng), group_size, rng)


def shape_lengths(context: int, tokens: int) -> list[tuple[int, int]]:
    """(sequences, length) of each of the trainer's one-length batches (TRAIN_SHAPES of `context`), each about
    `tokens` tokens, at least 2 sequences of at least 8 tokens."""
    out = []
    for fraction in TRAIN_SHAPES:
        length = max(8, int(context * fraction))
        out.append((max(2, round(tokens / length)), length))
    return out


def padded_lengths(n: int, length: int, micro_batch: int) -> list[int]:
    """`n` sequence lengths of about `length` (the longest is it) such that each of the trainer's micro-batches
    (its sorted, near-equal slices of at most `micro_batch`) holds one sequence a token shorter than the rest:
    every micro-batch is padded, as nearly every one in a run is. The trainer passes no attention mask when
    nothing in a micro-batch is padded, and its causal attention is then faster than the masked attention of a
    run's micro-batches: batches that are never padded would price attention too cheaply."""
    count = -(-n // micro_batch)
    out = []
    for i in range(count):
        size = (i + 1) * n // count - i * n // count
        top = length - 2 * (count - 1 - i)  # slices kept apart: sorting leaves them as they are
        out += [top - 1] + [top] * (size - 1)
    return out


def random_batch(model_config, lengths: list[tuple[int, int]], group_size: int, rng: random.Random) -> list:
    """Trajectories of random tokens with these (prompt, response) lengths, consecutive `group_size` forming a
    group, random log-probs and rewards, policy version 0."""
    from reference.trainer.batch import Trajectory

    out = []
    for i, (prompt, response) in enumerate(lengths):
        ids = [rng.randrange(model_config.vocab_size) for _ in range(prompt + response)]
        out.append(
            Trajectory(
                ids,
                [0] * prompt + [1] * response,
                [-rng.uniform(0.5, 6) for _ in range(response)],
                [0] * response,
                i // group_size,
                rng.random(),
            )
        )
    return out


def measure_trainer(model_config, task, pad_id: int, group_size: int, grid: Grid, trainer_config: dict) -> list[dict]:
    """The runtime's `Trainer.train_step`, with the run's trainer settings, on batches drawn from the workload
    (`repeats` batches at each size in `grid.train_sequences`, "kind" "workload") and on batches of one length
    each (`shape_lengths`, "kind" "shape"): each one's sequence lengths and seconds, the median of three steps on
    it (one step's time varies by a tenth or more on a shared machine). Each timed step follows the trainer
    publishing its weights (`published_steps`), as every step of a run does."""
    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.trainer import Trainer

    rng = random.Random(0)
    trainer = Trainer(build_model(model_config), TrainerConfig.from_dict(trainer_config), pad_id=pad_id)
    trainer.train_step(workload_batch(model_config, task, min(grid.train_sequences), group_size, rng))  # warm-up
    with tempfile.TemporaryDirectory() as root:
        step = published_steps(trainer, root)

        def median_s(batch) -> float:
            return statistics.median(step(batch) for _ in range(3))

        return _trainer_points(model_config, task, group_size, grid, trainer, rng, median_s)


def published_steps(trainer, root: str):
    """A function timing one `trainer.train_step(batch)` right after the trainer published its weights under
    `root` (the previous version removed), as the runtime calls them: a step, then a publish (which writes every
    weight out), then the next step. Whether a publish makes the next step slower is below this machine's
    noise (0.89-1.07x a step right after a step over four measurements: `python -m benchmarks.trainer_cold`);
    timed this way the part is what a run calls, whichever it is."""
    import shutil

    from reference.measure import seconds
    from reference.trainer.handoff import version_dir

    def step(batch) -> float:
        trainer.publish(root)
        if trainer.version > 0:  # the runtime prunes old versions
            shutil.rmtree(version_dir(root, trainer.version - 1), ignore_errors=True)
        return seconds(lambda: trainer.train_step(batch))

    return step


def _trainer_points(model_config, task, group_size: int, grid: Grid, trainer, rng, median_s) -> list[dict]:
    """`measure_trainer`'s points: workload batches, then batches of one length each, each timed by `median_s`."""
    points = []
    for n in grid.train_sequences:
        for _ in range(grid.repeats):
            b = workload_batch(model_config, task, n, group_size, rng)
            points.append({"kind": "workload", "seq_lens": [len(t.token_ids) for t in b], "seconds": median_s(b)})
    for n, length in shape_lengths(model_config.max_position_embeddings, grid.train_shape_tokens):
        lengths = padded_lengths(n, length, trainer.config.micro_batch_size)
        b = random_batch(model_config, [(t // 4 or 1, t - (t // 4 or 1)) for t in lengths], group_size, rng)
        points.append({"kind": "shape", "seq_lens": lengths, "seconds": median_s(b)})
    return points


def _dp_rank(
    rank: int, world: int, init: str, core: int, model_config, trainer_config: dict, pad_id: int, shards: list, results
) -> None:
    """One rank of `measure_data_parallel` (a process of its own): each step's seconds, into `results`."""
    import torch

    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.parallel import DataParallel, init_process_group
    from reference.trainer.trainer import Trainer

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init_process_group("gloo", init, rank, world)
    trainer = Trainer(
        build_model(model_config),
        TrainerConfig.from_dict(trainer_config),
        pad_id=pad_id,
        parallel=DataParallel(rank, world),
    )
    import torch.distributed as dist

    times = []
    with tempfile.TemporaryDirectory() as root:
        timed = published_steps(trainer, root)
        for step in shards:
            dist.barrier()
            times.append(timed(step[rank]))
    results.put((rank, times))
    dist.destroy_process_group()


def measure_data_parallel(
    model_config, task, pad_id: int, group_size: int, grid: Grid, trainer_config: dict, cores: list[int]
) -> list[dict]:
    """The runtime's trainer on its data-parallel layout: one gloo rank per core of `cores`, each a process on
    its core with one torch thread, on batches drawn from the workload (`repeats` at each size of
    `grid.train_sequences`, the first a warm-up) split as the runtime splits them (whole groups, balanced by
    tokens); each step's shards' sequence lengths and the seconds of its slowest rank (the step, as the run
    waits for it). With one core there is nothing to measure: []."""
    import multiprocessing

    from reference.control.executor import _shard

    if len(cores) < 2:
        return []
    rng = random.Random(1)
    least = len(cores) * group_size  # a group for every rank
    sizes = [
        max(least, n)
        for n in [min(grid.train_sequences)] + [n for n in grid.train_sequences for _ in range(grid.repeats)]
    ]
    steps = []
    for n in sizes:
        batch = workload_batch(model_config, task, n, group_size, rng)
        groups = [_Group(g) for g in sorted({t.group_id for t in batch})]
        steps.append(_shard(groups, batch, len(cores)))
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as root:
        init = f"file://{root}/rendezvous"
        procs = [
            ctx.Process(
                target=_dp_rank,
                args=(rank, len(cores), init, core, model_config, trainer_config, pad_id, steps, results),
            )
            for rank, core in enumerate(cores)
        ]
        for proc in procs:
            proc.start()
        try:
            times = dict(results.get(timeout=600) for _ in procs)
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    return [
        {
            "shards": [[len(t.token_ids) for t in shard] for shard in step],
            "seconds": max(times[rank][i] for rank in times),
        }
        for i, step in enumerate(steps)
        if i > 0
    ]


@dataclass(frozen=True)
class _Group:
    """What `_shard` reads of a finished group: its key (the trajectories' group id here)."""

    key: object


def fit_trainer(cfg, model, device, points: list[dict]) -> dict:
    """train_mfu m, train_attention_mfu a and train_step_overhead_s o of seconds = o + M / m + A / a + R, least
    squares over the points (M and A: the passes' matmul and attention compute at efficiency 1, R: the rest of
    sim/train_layout.py's step, all the simulator's for each point's sequence lengths, padded as its trainer
    pads them), by least squares of the relative error. Of the forms in CANDIDATE_FITS (a without o, a = m, the
    matmuls at the cap with the rest fitted, ...), the one that fits best with every term above 0 and every
    efficiency at most the cap (TRAIN_MFU_CAP)."""
    from sim import train_layout
    from sim.calibration import TRAIN_MFU_CAP, measured_setup

    cap = TRAIN_MFU_CAP
    same = measured_setup(cfg, train_mfu=cap, train_attention_mfu=None)
    half = measured_setup(cfg, train_mfu=cap, train_attention_mfu=cap / 2)  # attention's seconds doubled
    matmul, attention, rest, t = [], [], [], []
    for point in points:
        both = train_layout.step(same, model, device, point["seq_lens"], 1)
        attn = train_layout.step(half, model, device, point["seq_lens"], 1).train_compute_s - both.train_compute_s
        matmul.append((both.train_compute_s - attn) * cap)
        attention.append(attn * cap)
        rest.append(both.total_s - both.train_compute_s)
        t.append(point["seconds"])
    y, weight = np.array(t) - np.array(rest), 1 / np.array(t)  # least squares of the relative error
    columns = {"overhead": np.ones(len(y)), "matmul": np.array(matmul), "attention": np.array(attention)}
    columns["compute"] = columns["matmul"] + columns["attention"]
    best = None
    for names, capped in CANDIDATE_FITS:
        target = y - columns["matmul"] / cap if capped else y  # the matmuls at the cap, the rest fitted
        x = np.column_stack([columns[n] for n in names])
        coef, *_ = np.linalg.lstsq(x * weight[:, None], target * weight, rcond=None)
        got = dict(zip(names, (float(c) for c in coef), strict=True))
        inverse = 1 / cap if capped else got.get("matmul", got.get("compute"))
        if min(coef) <= 0 or inverse < 1 / cap or got.get("attention", inverse) < 1 / cap:
            continue  # a term at or below 0, or an efficiency above the cap
        error = float(np.sum(((x @ coef - target) * weight) ** 2))
        if best is None or error < best[0] - 1e-12:
            best = (error, got, inverse)
    if best is None:  # no fit within the bounds: the cap, nothing more
        return {"train_mfu": cap, "train_attention_mfu": None, "train_step_overhead_s": 0.0}
    _, got, inverse = best
    return {
        "train_mfu": 1.0 / inverse,
        "train_attention_mfu": 1.0 / got["attention"] if "attention" in got else None,
        "train_step_overhead_s": got.get("overhead", 0.0),
    }


# The forms `fit_trainer` tries (the terms fitted; whether the matmuls run at the cap), the best within bounds
# kept: attention at its own efficiency or at the matmuls', with or without a fixed overhead a step.
CANDIDATE_FITS = (
    (("overhead", "matmul", "attention"), False),
    (("overhead", "attention"), True),
    (("matmul", "attention"), False),
    (("attention",), True),
    (("overhead", "compute"), False),
    (("compute",), False),
)


def fit_data_parallel(cfg, model, device, points: list[dict], fitted: dict) -> float | None:
    """`train_dp_overhead_s`: what a data-parallel step costs beyond the simulator's step on the same sequences
    over as many GPUs with the one-rank constants `fitted` (`fit_trainer`): the collectives' floor, ranks that
    wait for the slowest. The median over the points, at least 0; None without points."""
    from sim import train_layout
    from sim.calibration import measured_setup

    if not points:
        return None
    setup = measured_setup(cfg, **fitted, train_dp_overhead_s=0.0)
    extra = []
    for point in points:
        seq_lens = [n for shard in point["shards"] for n in shard]
        predicted = train_layout.step(setup, model, device, seq_lens, len(point["shards"])).total_s
        extra.append(point["seconds"] - predicted)
    return max(0.0, float(statistics.median(extra)))
