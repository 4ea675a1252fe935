"""A ModelSpec's fields from a Hugging Face `config.json`, dense or mixture-of-experts (`core.specs.model` builds it).

Reads the standard keys of the Llama, Qwen2/2.5, Qwen3, Qwen2-MoE, Qwen3-MoE and Mixtral configs
(ModelSpec field <- config.json key; what an absent or null key means):

- layers, hidden, heads, intermediate, vocab, max_context <- num_hidden_layers, hidden_size,
  num_attention_heads, intermediate_size, vocab_size, max_position_embeddings; required
- kv_heads <- num_key_value_heads; num_attention_heads (multi-head attention)
- head_dim <- head_dim; hidden_size / num_attention_heads
- tie_embeddings <- tie_word_embeddings; false (the Llama, Qwen and Mixtral config classes' default)
- qk_norm <- use_qk_norm; true for model_type qwen3 and qwen3_moe (their attention norms q and k)
- qkv_bias <- qkv_bias, else attention_bias; true for model_type qwen2 and qwen2_moe (built in)
- experts <- num_experts (Qwen-MoE), num_local_experts (Mixtral) or n_routed_experts; 0: dense
- experts_per_token <- num_experts_per_tok; required with experts
- expert_intermediate <- moe_intermediate_size; intermediate_size (Mixtral's experts are that wide)
- shared_expert_intermediate <- shared_expert_intermediate_size, else n_shared_experts x
  moe_intermediate_size; 0
- moe_layers: layer i (from 0) is an MoE layer unless i is in mlp_only_layers or
  (i + 1) % decoder_sparse_step != 0 (Qwen-MoE), or i < first_k_dense_replace or
  i % moe_layer_freq != 0 (DeepSeek style); so by default every layer

Not modelled, so refused with a message naming the key: multi-head latent attention
(`kv_lora_rank`, DeepSeek-V2/V3), sliding-window or linear-attention layers (`use_sliding_window:
true`, `layer_types` other than full_attention). Ignored as too small to matter: Llama's
o_proj bias under `attention_bias` (hidden parameters a layer), Qwen2-MoE's one-output gate on the
shared expert (hidden parameters a layer). Multimodal configs (`text_config`) are not read.
"""

from __future__ import annotations

import json
from pathlib import Path

from core.errors import UserError

QK_NORM_TYPES = ("qwen3", "qwen3_moe")
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


_REQUIRED = object()


class _Config:
    """The parsed JSON object, with typed getters whose errors name the file and the key."""

    def __init__(self, data: dict, where: str) -> None:
        self.data, self.where = data, where

    def integer(self, key: str, default: object = _REQUIRED, minimum: int = 0) -> int:
        value = self.data.get(key)
        if value is None:  # absent, or null as HF writes unset keys (e.g. "head_dim": null)
            if default is _REQUIRED:
                raise UserError(f"{self.where} lacks the key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{self.where}: key {key!r} must be an integer, got {value!r}")
        if value < minimum:
            raise UserError(f"{self.where}: key {key!r} must be >= {minimum}, got {value}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise UserError(f"{self.where}: key {key!r} must be true or false, got {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise UserError(f"{self.where}: key {key!r} must be a list of integers, got {value!r}")
        return value

    def text(self, key: str) -> str:
        value = self.data.get(key) or ""
        if not isinstance(value, str):
            raise UserError(f"{self.where}: key {key!r} must be a string, got {value!r}")
        return value


def _read(path: str) -> tuple[dict, str]:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    where = f"model config {str(p)!r}"
    if not p.is_file():
        raise UserError(f"{where} does not exist; give a shipped model name or a Hugging Face config.json")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{where} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise UserError(f"{where} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{where} must hold a JSON object, got {type(data).__name__}")
    return data, where


def _refuse_unmodelled(c: _Config) -> None:
    if c.data.get("kv_lora_rank") is not None:
        raise UserError(f"{c.where}: key 'kv_lora_rank' (multi-head latent attention) is not modelled")
    if c.flag("use_sliding_window", False):
        raise UserError(f"{c.where}: key 'use_sliding_window' is true; sliding-window attention is not modelled")
    types = c.data.get("layer_types") or []
    if not isinstance(types, list):
        raise UserError(f"{c.where}: key 'layer_types' must be a list, got {types!r}")
    other = sorted({str(t) for t in types if t != "full_attention"})
    if other:
        raise UserError(f"{c.where}: key 'layer_types' has {other}; only full_attention layers are modelled")


def _moe_fields(c: _Config, layers: int, intermediate: int) -> dict:
    """The MoE fields of ModelSpec (none for a dense model)."""
    expert_keys = [k for k in EXPERT_COUNT_KEYS if c.data.get(k) is not None]
    experts = c.integer(expert_keys[0]) if expert_keys else 0
    if not experts:
        return {}
    width = c.integer("moe_intermediate_size", intermediate, minimum=1)
    shared = c.integer("shared_expert_intermediate_size", c.integer("n_shared_experts", 0) * width)
    dense = set(c.int_list("mlp_only_layers"))
    step = c.integer("decoder_sparse_step", 1, minimum=1)
    first = c.integer("first_k_dense_replace", 0)
    freq = c.integer("moe_layer_freq", 1, minimum=1)
    moe_layers = sum(
        1 for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first and i % freq == 0
    )
    if not moe_layers:
        raise UserError(f"{c.where}: {expert_keys[0]}={experts} but no layer is a mixture-of-experts layer")
    per_token = c.integer("num_experts_per_tok", minimum=1)
    if per_token > experts:
        raise UserError(f"{c.where}: key 'num_experts_per_tok' ({per_token}) exceeds {expert_keys[0]} ({experts})")
    return {
        "experts": experts,
        "experts_per_token": per_token,
        "expert_intermediate": width,
        "shared_expert_intermediate": shared,
        "moe_layers": moe_layers,
    }


def model_fields(path: str) -> dict[str, object]:
    """The ModelSpec fields of the Hugging Face config.json at `path` (or in the folder `path`), named `path`."""
    data, where = _read(path)
    c = _Config(data, where)
    _refuse_unmodelled(c)
    layers = c.integer("num_hidden_layers", minimum=1)
    hidden = c.integer("hidden_size", minimum=1)
    heads = c.integer("num_attention_heads", minimum=1)
    intermediate = c.integer("intermediate_size")
    moe = _moe_fields(c, layers, intermediate)
    if intermediate < 1 and layers > moe.get("moe_layers", 0):
        raise UserError(f"{where}: key 'intermediate_size' must be >= 1 (the model has dense MLP layers)")
    model_type = c.text("model_type")
    return dict(
        name=path,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=c.integer("num_key_value_heads", heads, minimum=1),
        head_dim=c.integer("head_dim", hidden // heads, minimum=1),
        intermediate=intermediate,
        vocab=c.integer("vocab_size", minimum=1),
        tie_embeddings=c.flag("tie_word_embeddings", False),
        max_context=c.integer("max_position_embeddings", minimum=1),
        qk_norm=c.flag("use_qk_norm", model_type in QK_NORM_TYPES),
        qkv_bias=c.flag("qkv_bias", c.flag("attention_bias", model_type in QKV_BIAS_TYPES)),
        **moe,
    )
