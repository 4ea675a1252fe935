"""Device and model specs: the shipped ones in the YAML files beside this module, or the user's own.

A model is a shipped name (`models.yaml`) or a path to a Hugging Face `config.json` (dense or
mixture-of-experts; `hf_config.py` reads it). A device is a shipped name (`devices.yaml`) or a path
to a YAML file with the same fields. Derived quantities (parameter counts, KV bytes per token,
FLOPs per token) are computed from the architecture, never typed in, so a new model is one line in
`models.yaml`.

A model is a decoder-only transformer with grouped-query attention and SwiGLU MLPs (Qwen2/2.5/3,
Llama 3, Mixtral, Qwen-MoE). In a mixture-of-experts (MoE) layer the MLP is `experts` routed
experts, each a SwiGLU MLP `expert_intermediate` wide, of which a token uses `experts_per_token`,
plus a router (hidden x experts) and, if `shared_expert_intermediate` > 0, an always-active shared
expert of that width. `moe_layers` of the `layers` are MoE layers; the rest have a dense MLP
`intermediate` wide.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields
from functools import cache, cached_property
from pathlib import Path

import yaml

from core.errors import UserError, unknown_name
from core.specs.hf_config import model_fields

_HERE = Path(__file__).parent
BF16_BYTES = 2


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. Bandwidths are GB/s per device, one direction; nvlink_gb_s and network_gb_s
    are already what a transfer can use (the costs.*_efficiency constants then apply on top)."""

    name: str
    description: str
    peak_tflops: float  # bf16 dense tensor-core peak
    hbm_gb: float
    hbm_bandwidth_gb_s: float
    nvlink_gb_s: float  # GPU to GPU within a node (over PCIe where there is no NVLink)
    network_gb_s: float  # GPU to GPU across nodes, per GPU
    pcie_gb_s: float  # GPU to host memory
    gpus_per_node: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "description") and value <= 0:
                raise UserError(f"device {self.name!r}: {f.name} must be > 0, got {value}")


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape (see the module docstring). Equality compares the architecture, not the name,
    so a shipped spec equals the spec read from the same model's config.json."""

    name: str = field(compare=False)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's width (unused when every layer is MoE)
    vocab: int
    tie_embeddings: bool
    max_context: int
    qk_norm: bool = False  # RMSNorm on each query and key head (Qwen3)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2, Qwen2.5)
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    expert_intermediate: int = 0  # one routed expert's width
    shared_expert_intermediate: int = 0  # the always-active shared expert's width (0: none)
    moe_layers: int = 0  # how many of `layers` are MoE layers

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "max_context"):
            if getattr(self, key) < 1:
                raise UserError(f"model {self.name!r}: {key} must be >= 1, got {getattr(self, key)}")
        if self.experts:
            if not 1 <= self.experts_per_token <= self.experts:
                raise UserError(
                    f"model {self.name!r}: experts_per_token must be in [1, experts={self.experts}], "
                    f"got {self.experts_per_token}"
                )
            if self.expert_intermediate < 1 or not 1 <= self.moe_layers <= self.layers:
                raise UserError(
                    f"model {self.name!r}: an MoE model needs expert_intermediate >= 1 and 1 <= moe_layers <= "
                    f"layers, got expert_intermediate={self.expert_intermediate}, moe_layers={self.moe_layers}"
                )
        elif self.moe_layers or self.experts_per_token:
            raise UserError(f"model {self.name!r}: moe_layers and experts_per_token need experts >= 1")
        if self.dense_layers and self.intermediate < 1:
            raise UserError(f"model {self.name!r}: intermediate must be >= 1 with {self.dense_layers} dense layers")

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @cached_property
    def attn_dim(self) -> int:
        """Width of the query projection: heads x head_dim (not always `hidden`, e.g. Qwen3-32B)."""
        return self.heads * self.head_dim

    @cached_property
    def _attn_and_norms(self) -> int:
        """Parameters of a layer outside its MLP: q, k, v, o projections (and biases), norms."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * self.attn_dim * 2 + self.hidden * kv * 2
        attn += (self.attn_dim + 2 * kv) if self.qkv_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return attn + norms

    @cached_property
    def expert_params(self) -> int:
        """One routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.expert_intermediate

    @cached_property
    def _moe_always(self) -> int:
        """Parameters of an MoE layer's MLP that every token uses: the router and the shared expert."""
        return self.hidden * self.experts + 3 * self.hidden * self.shared_expert_intermediate

    @cached_property
    def dense_layer_params(self) -> int:
        return self._attn_and_norms + 3 * self.hidden * self.intermediate

    @cached_property
    def moe_layer_params(self) -> int:
        """An MoE layer with all its experts (0 for a dense model)."""
        if not self.is_moe:
            return 0
        return self._attn_and_norms + self._moe_always + self.experts * self.expert_params

    @cached_property
    def layer_params(self) -> int:
        """The largest decoder layer: a dense one, or an MoE one with all its experts."""
        return max(self.dense_layer_params if self.dense_layers else 0, self.moe_layer_params)

    @cached_property
    def params(self) -> int:
        """Every parameter (all experts): what memory, weight sync and optimizer state scale with."""
        embeddings = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        layers = self.dense_layers * self.dense_layer_params + self.moe_layers * self.moe_layer_params
        return layers + embeddings + self.hidden

    @cached_property
    def matmul_params(self) -> int:
        """Parameters one token takes part in a matmul with: what FLOPs scale with. The input
        embedding is a lookup; an MoE layer counts its router, shared expert and the
        `experts_per_token` routed experts the token goes to (its active parameters)."""
        active_moe = self._attn_and_norms + self._moe_always + self.experts_per_token * self.expert_params
        layers = self.dense_layers * self.dense_layer_params + self.moe_layers * active_moe
        return layers + self.vocab * self.hidden

    @cached_property
    def routed_expert_bytes(self) -> int:
        """bf16 bytes of one routed expert of one layer."""
        return self.expert_params * BF16_BYTES

    @cached_property
    def weight_bytes(self) -> int:
        return self.params * BF16_BYTES

    @cached_property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16_BYTES


# ---- building specs from mappings (the shipped YAML files, a user's device file) ----


def _kind_of(tp: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


def _check_value(tp: type, value: object, where: str, key: str) -> object:
    ok = isinstance(value, tp) and not (tp in (int, float) and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise UserError(f"{where}: {key!r} must be {_kind_of(tp)}, got {value!r}")
    return value


def from_mapping(cls: type, values: object, where: str, defaults: dict | None = None) -> object:
    """`cls` from a mapping, naming the bad key in `where` when one is unknown, missing or mistyped."""
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a mapping of keys to values, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    unknown = [k for k in values if k not in known]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(known)}")
    merged = {**(defaults or {}), **values}
    missing = [f.name for f in fields(cls) if f.name not in merged and f.default is MISSING]
    if missing:
        raise UserError(f"{where} lacks {missing[0]!r} (required: {', '.join(missing)})")
    kwargs = {k: _check_value(hints[k], v, where, k) for k, v in merged.items()}
    return cls(**kwargs)


def _load_shipped(filename: str, cls: type, kind: str) -> dict:
    raw = yaml.safe_load((_HERE / filename).read_text())
    return {key: from_mapping(cls, entry, f"{kind} {key!r} in {filename}", {"name": key}) for key, entry in raw.items()}


@cache
def devices() -> dict[str, DeviceSpec]:
    return _load_shipped("devices.yaml", DeviceSpec, "device")


@cache
def models() -> dict[str, ModelSpec]:
    return _load_shipped("models.yaml", ModelSpec, "model")


def _looks_like_path(name: str, suffixes: tuple[str, ...]) -> bool:
    return "/" in name or "\\" in name or name.lower().endswith(suffixes) or Path(name).exists()


def device_from_file(path: str) -> DeviceSpec:
    """A device from a YAML file holding the fields of a `devices.yaml` entry (`name` and
    `description` optional: the file's stem by default)."""
    p = Path(path)
    where = f"device file {path!r}"
    if p.is_dir():
        raise UserError(f"{where} is a folder; give a shipped device name or a device YAML file")
    if not p.is_file():
        raise UserError(f"{where} does not exist; give a shipped device name or a device YAML file")
    try:
        values = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{where} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{where} is not valid YAML: {' '.join(str(exc).split())}") from None
    return from_mapping(DeviceSpec, values, where, {"name": p.stem, "description": p.stem})


def device(name: str) -> DeviceSpec:
    """A shipped device by name (any case), or a device YAML file by path."""
    found = devices().get(name.lower())
    if found is not None:
        return found
    if _looks_like_path(name, (".yaml", ".yml")):
        return device_from_file(name)
    raise UserError(f"{unknown_name('device', name, devices())}; or a path to a device YAML file")


def model(name: str) -> ModelSpec:
    """A shipped model by name (any case), or a Hugging Face config.json (or its folder) by path."""
    found = models().get(name.lower())
    if found is not None:
        return found
    if _looks_like_path(name, (".json",)):
        return ModelSpec(**model_fields(name))
    raise UserError(f"{unknown_name('model', name, models())}; or a path to a Hugging Face config.json")
