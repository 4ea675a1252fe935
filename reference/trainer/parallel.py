"""Data parallelism for the trainer: plain gradient all-reduce, or FSDP (gloo on CPU, NCCL on GPUs).

Every rank holds its own shard of the step's trajectories (whole groups: see `shard_by_group`). The
loss is divided by the step's GLOBAL generated-token count, so summing the ranks' gradients gives
exactly the gradient of the global token mean:

- `DataParallel(fsdp=False)`: after the last micro-batch, one all-reduce (SUM) of every gradient,
  flattened into one buffer. Parameters are broadcast from rank 0 once, at construction.
- `DataParallel(fsdp=True)`: each decoder layer and the root are wrapped with FSDP2's
  `fully_shard`; FSDP averages gradients over ranks in its reduce-scatter, so the loss is multiplied by
  the world size (`loss_scale`) to turn that average back into the sum. Gradients are reduce-scattered
  after every micro-batch's backward and accumulate in their shards: skipping the sync on all but the last
  micro-batch (FSDP's no-sync) would keep every layer's unsharded gradient until then, the whole model's
  (measured on Qwen3-0.6B's shape, two ranks: 2 GB more a rank at its peak; for a 32B model, 64 GB in
  bf16). Parameters, gradients and AdamW's moments are sharded: a rank holds 1 / world_size of them.
  `param_dtype="bfloat16"` is mixed precision: each layer's parameters are
  all-gathered and computed in bf16, gradients reduced in fp32 into the fp32 sharded master weights the
  optimiser steps (FSDP2's `MixedPrecisionPolicy`). Runs on CPU (gloo) as on GPUs (NCCL).
- `activation_checkpointing=True`: each decoder layer's activations are recomputed in the backward
  instead of kept (Hugging Face's gradient checkpointing, non-reentrant), with or without FSDP.

The process group is torch.distributed's default group; `init_process_group` creates it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_process_group(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
    """Join (or create) the default process group; `init_method` e.g. `file:///tmp/x` or `tcp://host:port`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


@dataclass(frozen=True)
class DataParallel:
    """Which rank this process is and how gradients are combined; the default is a single process."""

    rank: int = 0
    world_size: int = 1
    fsdp: bool = False
    param_dtype: str = "float32"  # the dtype layers compute in under FSDP (master weights stay fp32)
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in the backward

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {self.rank}, world_size {self.world_size}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"unknown param_dtype {self.param_dtype!r}; choose one of {list(PARAM_DTYPES)}")
        if self.param_dtype != "float32" and not self.fsdp:
            raise ValueError(f"param_dtype {self.param_dtype!r} needs fsdp (mixed precision is FSDP's)")
        if (self.world_size > 1 or self.fsdp) and not dist.is_initialized():
            raise ValueError("data parallelism needs torch.distributed initialised first (init_process_group)")

    @classmethod
    def from_process_group(cls, fsdp: bool = False, **settings) -> DataParallel:
        """This process's place in the default process group (`settings`: param_dtype, activation_checkpointing)."""
        return cls(dist.get_rank(), dist.get_world_size(), fsdp, **settings)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def loss_scale(self) -> float:
        """FSDP averages gradients over ranks; scaling the loss by the world size turns that into a sum."""
        return float(self.world_size) if self.fsdp else 1.0

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Shard the model (FSDP) or make every rank start from rank 0's parameters (plain DP); with
        `activation_checkpointing`, its decoder layers recompute their activations in the backward."""
        if self.activation_checkpointing:
            _checkpoint_layers(model)
        if self.fsdp:
            self.shard(model)
        elif self.world_size > 1:
            with torch.no_grad():
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor, src=0)
        return model

    def shard(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over each decoder layer and the root, computing in `param_dtype`, reducing in fp32. Also for the
        frozen KL reference model, so that it is sharded like the policy."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[self.param_dtype], reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Plain DP: sum every gradient over ranks (FSDP has already done it)."""
        if self.fsdp or self.world_size == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` reduced over ranks (in place, also returned); `op` is "sum" or "max"."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"unknown reduce op {op!r}; choose one of {list(ops)}")
        if not self.distributed:
            return tensor
        if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
            on_device = tensor.cuda()
            dist.all_reduce(on_device, op=ops[op])
            return tensor.copy_(on_device.cpu())
        dist.all_reduce(tensor, op=ops[op])
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter and buffer, unsharded, on CPU (with FSDP: gathered on every rank)."""
        if not self.fsdp:
            return {k: v.detach().cpu() for k, v in model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not self.fsdp:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(model, optimizer, options=options)

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if not self.fsdp:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def _checkpoint_layers(model: torch.nn.Module) -> None:
    """Hugging Face's activation checkpointing of every decoder layer, non-reentrant (the API's name changed
    in transformers 5.x; the older name is what earlier 5.x releases have)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
