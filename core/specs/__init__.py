"""Device and model specs, read from the YAML files shipped beside this module.

Derived quantities (parameter counts, KV bytes per token, FLOPs per token) are computed from the
architecture, never typed in, so a new model is one line in `models.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cache, cached_property
from pathlib import Path

import yaml

from core.errors import UserError, unknown_name

_HERE = Path(__file__).parent
BF16_BYTES = 2


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    description: str
    peak_tflops: float
    hbm_gb: float
    hbm_bandwidth_gb_s: float
    nvlink_gb_s: float
    network_gb_s: float
    pcie_gb_s: float
    gpus_per_node: int


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool
    max_context: int

    @cached_property
    def attn_dim(self) -> int:
        """Width of the query projection: heads x head_dim (not always `hidden`, e.g. Qwen3-32B)."""
        return self.heads * self.head_dim

    @cached_property
    def layer_params(self) -> int:
        attn = self.hidden * self.attn_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        norms = 2 * self.hidden + 2 * self.head_dim
        return attn + mlp + norms

    @cached_property
    def params(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return self.layers * self.layer_params + embeddings + self.hidden

    @cached_property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the input embedding is a lookup)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


def _load(filename: str, cls: type, kind: str) -> dict:
    raw = yaml.safe_load((_HERE / filename).read_text())
    names = {f.name for f in fields(cls)} - {"name"}
    out = {}
    for key, values in raw.items():
        missing = names - values.keys()
        if missing:
            raise UserError(f"{kind} {key!r} in {filename} lacks {sorted(missing)}")
        out[key] = cls(name=key, **{k: values[k] for k in names})
    return out


@cache
def devices() -> dict[str, DeviceSpec]:
    return _load("devices.yaml", DeviceSpec, "device")


@cache
def models() -> dict[str, ModelSpec]:
    return _load("models.yaml", ModelSpec, "model")


def device(name: str) -> DeviceSpec:
    try:
        return devices()[name.lower()]
    except KeyError:
        raise unknown_name("device", name, devices()) from None


def model(name: str) -> ModelSpec:
    try:
        return models()[name.lower()]
    except KeyError:
        raise unknown_name("model", name, models()) from None
