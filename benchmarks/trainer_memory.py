"""How much memory does a trainer step of a real-shaped Qwen3 take, and does the simulator's training
memory model predict it? One GRPO step (`Trainer.train_step`) of a random-initialised model of a
shipped shape (`core/specs/models.yaml`, optionally with fewer layers) on one sequence per micro-batch
of `--tokens` tokens, the last `--generated` share of them generated (an agent episode: most tokens are
prompt and tool output), on `--ranks` gloo processes of this CPU with the run's `trainer_parallel`
settings (FSDP, bf16 compute with fp32 masters, activation checkpointing); with `--device cuda`, on one
GPU a rank over NCCL (ranks <= the GPUs torch sees).

Measured per rank on a CPU: the resident memory the step adds at its peak (Linux's VmHWM, reset just
before the step, less the resident memory before the model was built: the interpreter and libraries); on
a GPU: the allocator's peak during the step (`torch.cuda.max_memory_allocated`, the model's sharded state
included, since nothing else lives on the GPU) and what it reserved. The step's seconds are the last of
`--steps` (the first one on a GPU pays cuBLAS's and the allocator's warm-up; on a CPU keep 1: memory an
earlier step freed but the C allocator kept stays resident and counts, 0.8 GB more at 1,024 tokens on two
layers); tokens/s counts every position of every rank's sequences. Beside it the simulator's
`sim.train_layout.memory` for the same model, sequence and layout (state, gather buffers, activations;
fp32 activations count twice its bf16 estimate, as `reference/control/plan.py` does; the loss's logits
are the trained tokens', `trainer.logit_chunk_tokens` at a time, in fp32).

    python -m benchmarks.trainer_memory --model qwen3-0.6b --layers 4 --tokens 8192
    python -m benchmarks.trainer_memory --model qwen3-0.6b --layers 4 --tokens 8192 --param-dtype float32 --no-fsdp
    python -m benchmarks.trainer_memory --device cuda --ranks 1 --steps 2 --model qwen3-1.7b --tokens 32768

Linux only on a CPU (it reads /proc/self/status and writes /proc/self/clear_refs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GB = 1e9


def _rss(field: str) -> float:
    """A VmRSS/VmHWM figure of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return float(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Hand freed heap back to the OS (glibc's malloc_trim: the full-precision model built before it was sharded
    would otherwise stay resident and count), then reset VmHWM to the resident size."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then include freed, retained memory
        pass
    Path("/proc/self/clear_refs").write_text("5")


def _config(args):
    from transformers import Qwen3Config

    from core import specs

    m = specs.model(args.model)
    return Qwen3Config(
        vocab_size=m.vocab,
        hidden_size=m.hidden,
        intermediate_size=m.intermediate,
        num_attention_heads=m.heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim,
        num_hidden_layers=args.layers or m.layers,
        max_position_embeddings=max(args.tokens, 128),
        tie_word_embeddings=m.tie_embeddings,
        rms_norm_eps=1e-6,
    )


def _batch(args, rank: int):
    from reference.trainer.batch import Trajectory

    gen = max(1, int(args.tokens * args.generated))
    g = torch.Generator().manual_seed(rank)
    out = []
    for reward in (0.0, 1.0):  # one group of two: non-zero advantages, every rank its own group
        ids = torch.randint(10, 1000, (args.tokens,), generator=g).tolist()
        mask = [0] * (args.tokens - gen) + [1] * gen
        out.append(Trajectory(ids, mask, [-1.0] * gen, [0] * gen, f"g{rank}", reward))
    return out


def _rank(rank: int, args, init: str, out: str) -> None:
    from reference.trainer.parallel import init_process_group

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    baseline = 0.0 if cuda else _rss("VmRSS")
    if args.ranks > 1 or args.fsdp:
        init_process_group("nccl" if cuda else "gloo", init, rank, args.ranks)
    try:
        record = _measure(rank, args, baseline)
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(rank: int, args, baseline: float) -> dict:
    """`--steps` GRPO steps of this rank's trainer; the last one's seconds and peak memory."""
    from reference.model import build_model
    from reference.trainer.config import TrainerConfig
    from reference.trainer.parallel import DataParallel
    from reference.trainer.trainer import Trainer

    cuda = args.device == "cuda"
    parallel = DataParallel(rank, args.ranks, args.fsdp, args.param_dtype, args.checkpointing)
    config = TrainerConfig(micro_batch_size=1, entropy_coef=0.0, lr=1e-6, seed=rank)
    with torch.device("cuda" if cuda else "cpu"):  # a GPU's model is built there: no full copy in host memory
        model = build_model(_config(args), seed=0)
    trainer = Trainer(model, config, pad_id=0, parallel=parallel)
    batch = _batch(args, rank)
    for _ in range(args.steps - 1):
        trainer.train_step(batch)
    parallel.barrier()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()
    start = time.perf_counter()
    trainer.train_step(batch)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if cuda:
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        peak, reserved = _rss("VmHWM") - baseline, 0.0
    return {"rank": rank, "seconds": seconds, "peak_added": peak, "reserved": reserved, "baseline": baseline}


def simulated(args):
    """The simulator's training memory per GPU for this model, sequence and layout (GB: state, buffers, act)."""
    import dataclasses

    from core import config as cfgio
    from core import specs
    from sim import train_layout
    from sim.config import DEFAULT_CONFIG, SimConfig

    model = specs.model(args.model)
    if args.layers:
        model = dataclasses.replace(model, layers=args.layers)
    train = {
        "grad_bytes_per_param": 4,
        "optimizer_bytes_per_param": 10,
        "reference_model": False,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "micro_batch_tokens": args.tokens,
        "mini_batches": 1,
        "activation_recompute": "full" if args.checkpointing else "none",
        "fsdp_root_gathered": True,
    }
    cfg = cfgio.from_dict(SimConfig, cfgio.merge(cfgio.load_yaml(DEFAULT_CONFIG), {"train": train}))
    device = specs.device("h200")  # only the layout's shape is read: one GPU per rank, no tensor parallel
    lay = train_layout.layout(cfg, model, device, args.ranks)
    from reference.trainer.config import TrainerConfig

    width = 1 if args.param_dtype == "bfloat16" else 2
    layers = width * train_layout.activation_bytes(model, lay, cfg.train.activation_recompute, args.tokens, 0)
    trained = max(1, int(args.tokens * args.generated))  # only trained tokens are projected onto the vocabulary
    act = (layers + train_layout.logit_bytes(model, trained, TrainerConfig.logit_chunk_tokens)) / GB
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_gb=act))
    mem = train_layout.memory(cfg, model, device, args.ranks, args.tokens)
    state = mem.state_gb if args.fsdp else mem.state_gb * args.ranks
    return state, mem.buffers_gb if args.fsdp else 0.0, mem.activations_gb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="a shipped model shape (core/specs/models.yaml)")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own count)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of each sequence")
    p.add_argument("--generated", type=float, default=0.1, help="share of each sequence that is generated")
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (processes; on cuda one GPU each)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo ranks; cuda: NCCL ranks")
    p.add_argument("--steps", type=int, default=1, help="steps a rank runs; the last one is measured")
    p.add_argument("--param-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--no-fsdp", dest="fsdp", action="store_false")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    args = p.parse_args(argv)
    if args.tokens < 2 or args.ranks < 1 or args.layers < 0 or args.steps < 1 or not 0 < args.generated < 1:
        p.error("need --tokens >= 2, --ranks >= 1, --layers >= 0, --steps >= 1 and 0 < --generated < 1")
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        p.error(f"--device cuda --ranks {args.ranks} needs {args.ranks} GPUs; torch sees {torch.cuda.device_count()}")
    if args.param_dtype == "bfloat16" and not args.fsdp:
        p.error("--param-dtype bfloat16 needs FSDP (drop --no-fsdp)")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args, f"file://{tmp}/init", tmp), nprocs=args.ranks, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    seconds = max(r["seconds"] for r in ranks)
    peak = max(r["peak_added"] for r in ranks) / GB
    state, buffers, act = simulated(args)
    predicted = state + buffers + act
    what = (
        f"{args.model} x {args.layers or 'all'} layers, {args.tokens} tokens a sequence "
        f"({args.generated:.0%} generated), {args.ranks} ranks, fsdp {args.fsdp}, {args.param_dtype}, "
        f"checkpointing {args.checkpointing}, {args.device}"
    )
    print(what)
    print(f"step: {seconds:.1f} s, {2 * args.tokens * args.ranks / seconds:,.0f} tokens/s")
    if args.device == "cuda":
        reserved = max(r["reserved"] for r in ranks) / GB
        print(f"peak allocated per GPU: {peak:.2f} GB (reserved by the allocator: {reserved:.2f} GB)")
    else:
        print(f"peak added per rank: {peak:.2f} GB (before the model: {ranks[0]['baseline'] / GB:.2f} GB resident)")
    print(
        f"simulator: {predicted:.2f} GB (state {state:.2f} + buffers {buffers:.2f} + activations {act:.2f}); "
        f"measured / simulated {peak / predicted:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
