"""Fixtures for the trainer's tests: a very small Qwen3 over the 22-token task vocabulary."""

from __future__ import annotations

import pytest

from reference.model import build_model, tiny_config
from reference.tasks.tokenizer import task_tokenizer

VOCAB = 22


def small_config():
    return tiny_config(
        VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        initializer_range=0.02,
    )


@pytest.fixture(scope="session")
def make_model():
    """`make_model(seed=0)`: a fresh 1-layer, 32-wide float32 Qwen3 over 22 ids."""

    def make(seed: int = 0):
        return build_model(small_config(), seed)

    return make


@pytest.fixture(scope="session")
def task_tok():
    tok = task_tokenizer()
    assert tok.vocab_size == VOCAB
    return tok
