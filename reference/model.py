"""Qwen3-architecture models through `transformers`: a tiny random-init default, and real checkpoints.

`tiny_config` / `build_model` / `default_model` give a small Qwen3 (same architecture as the real
family: GQA, per-head q/k RMSNorm, RoPE theta 1e6, tied embeddings) that runs on a laptop CPU; its
weights are random, so its text is gibberish, but every mechanism (engine, logprobs, weight updates)
behaves as with a trained model. `load_checkpoint` reads a real Qwen3 checkpoint from a local
directory; nothing is ever downloaded. `score_logprobs` is the plain-transformers reference scorer the
consistency checks compare engines against; it deliberately shares no code with any engine.
Departure from Qwen3's init: `initializer_range` 0.1 instead of 0.02 (see `TINY_DEFAULTS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

from reference.tokenizer import Tokenizer, default_tokenizer

TINY_DEFAULTS = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    # Wider than Qwen3's 0.02 so a random model's next-token distributions are peaked, not near-uniform:
    # greedy decoding then has clear winners and sampled text is less flat.
    "initializer_range": 0.1,
}


def tiny_config(vocab_size: int, **overrides) -> Qwen3Config:
    """A tiny Qwen3 config (256 hidden, 4 layers, 4 heads / 2 KV heads of 64, 8192 context); `overrides`
    replace any field. `vocab_size` is used as given: pass the tokenizer's size."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    fields = {**TINY_DEFAULTS, **overrides, "vocab_size": vocab_size}
    if fields["max_position_embeddings"] < 1:
        raise ValueError(f"max_position_embeddings must be >= 1, got {fields['max_position_embeddings']}")
    return Qwen3Config(**fields)


def build_model(config: Qwen3Config, seed: int = 0) -> Qwen3ForCausalLM:
    """A float32 model in eval mode, initialised from `seed` only (the global torch RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.to(torch.float32).eval()


def default_model(seed: int = 0) -> tuple[Qwen3ForCausalLM, Tokenizer]:
    """The tiny random-init model over the shipped tokenizer (vocabulary = tokenizer size)."""
    tokenizer = default_tokenizer()
    return build_model(tiny_config(tokenizer.vocab_size), seed), tokenizer


def save_checkpoint(model: Qwen3ForCausalLM, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Hugging Face layout: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    directory = Path(directory)
    with _no_progress_bars():
        model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory)
    return directory


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' bars for writing or loading a local checkpoint are noise in a worker's log."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _check_qwen3_dir(directory: Path) -> None:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint directory: no config.json")
    model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    if model_type != "qwen3":
        raise ValueError(f"{directory} holds a {model_type!r} model; only 'qwen3' checkpoints are supported")
    if not _weight_files(directory):
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")


def load_checkpoint(directory: str | Path) -> tuple[Qwen3ForCausalLM, Tokenizer]:
    """A Qwen3 model (float32, eval) and its tokenizer from a local directory; never downloads."""
    directory = Path(directory)
    _check_qwen3_dir(directory)
    tokenizer = Tokenizer.load(directory)
    with _no_progress_bars():
        model = Qwen3ForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    return model.eval(), tokenizer


def _weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in the directory's safetensors files (one file or shards)."""
    directory = Path(directory)
    files = _weight_files(directory)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_weights(model: Qwen3ForCausalLM, directory: str | Path) -> None:
    """Copy a checkpoint directory's weights into `model` in place (every parameter must be present)."""
    copy_weights(model, read_state_dict(directory), origin=str(directory))


def copy_weights(model: Qwen3ForCausalLM, state: dict[str, torch.Tensor], origin: str = "state dict") -> None:
    """Copy `state` into `model`'s tensors in place, after checking names and shapes (a tied lm_head may
    be absent). Nothing is copied if anything does not fit."""
    own = model.state_dict()
    if model.config.tie_word_embeddings:
        own.pop("lm_head.weight", None)
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"weights from {origin} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    bad = [k for k in own if own[k].shape != state[k].shape]
    if bad:
        k = bad[0]
        raise ValueError(
            f"weights from {origin}: {k} has shape {tuple(state[k].shape)}, model has {tuple(own[k].shape)}"
        )
    with torch.no_grad():
        for k, tensor in own.items():
            tensor.copy_(state[k].to(device=tensor.device, dtype=tensor.dtype))


@torch.no_grad()
def score_logprobs(model: Qwen3ForCausalLM, token_ids: Sequence[int], temperature: float = 1.0) -> list[float]:
    """log p(token_i | tokens[:i]) for i = 1..n-1 under softmax(logits / temperature), from one plain forward pass."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if len(token_ids) < 2:
        return []
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()
