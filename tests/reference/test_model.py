"""Tiny Qwen3 models: config, seeded init, checkpoint round trips, weight loading, the reference scorer."""

from __future__ import annotations

import json

import pytest
import torch

from reference.model import (
    build_model,
    copy_weights,
    default_model,
    load_checkpoint,
    load_weights,
    save_checkpoint,
    score_logprobs,
    tiny_config,
)
from reference.tokenizer import Tokenizer, default_tokenizer

SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "head_dim": 16}


def small_model(seed: int = 0, **overrides):
    return build_model(tiny_config(default_tokenizer().vocab_size, **{**SMALL, **overrides}), seed)


def test_tiny_config_is_qwen3_shaped():
    c = tiny_config(4096)
    assert c.model_type == "qwen3" and c.vocab_size == 4096
    assert c.max_position_embeddings >= 8192
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 64)
    assert c.tie_word_embeddings and c.rope_parameters["rope_theta"] == 1e6
    assert tiny_config(100, num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        tiny_config(0)


def test_build_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    a, b, c = small_model(0), small_model(0), small_model(1)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.dtype == torch.float32 and not a.training


def test_default_model_matches_tokenizer():
    model, tok = default_model()
    assert model.config.vocab_size == tok.vocab_size == 4096


def test_checkpoint_round_trip(tmp_path):
    model, tok = small_model(3), default_tokenizer()
    save_checkpoint(model, tok, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
    loaded, loaded_tok = load_checkpoint(tmp_path)
    ids = torch.tensor([tok.encode("The river was low that autumn.")])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded_tok.encode("hi <|im_end|>") == tok.encode("hi <|im_end|>")
    assert Tokenizer.load(tmp_path).vocab_size == tok.vocab_size


def test_load_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"holds a 'llama' model; only 'qwen3'"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors weights in {tmp_path}"):
        load_checkpoint(tmp_path)


def test_load_weights_replaces_every_parameter(tmp_path):
    source, target = small_model(1), small_model(2)
    save_checkpoint(source, default_tokenizer(), tmp_path)
    load_weights(target, tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(target(ids).logits, source(ids).logits)
    assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied


def test_load_weights_rejects_misfits(tmp_path):
    save_checkpoint(small_model(1, hidden_size=32), default_tokenizer(), tmp_path)
    target = small_model(2)
    before = target.model.embed_tokens.weight.clone()
    with pytest.raises(ValueError, match="has shape"):
        load_weights(target, tmp_path)
    assert torch.equal(target.model.embed_tokens.weight, before)  # nothing copied
    with pytest.raises(ValueError, match="missing"):
        copy_weights(target, {"model.norm.weight": torch.ones(64)})


def test_score_logprobs_matches_naive_prefix_loop():
    model = small_model(4)
    ids = [3, 99, 1024, 7, 7, 7, 2048, 15, 4095]
    fast = score_logprobs(model, ids)
    with torch.no_grad():
        naive = [
            torch.log_softmax(model(torch.tensor([ids[:i]])).logits[0, -1], -1)[ids[i]].item()
            for i in range(1, len(ids))
        ]
    assert len(fast) == len(ids) - 1
    assert fast == pytest.approx(naive, abs=1e-5)
    assert score_logprobs(model, [5]) == []
