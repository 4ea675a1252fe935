"""The byte-level BPE tokenizer: lossless round trips, special tokens, deterministic builds, disk layout."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from reference.tokenizer import (
    DEFAULT_TOKENIZER,
    SPECIAL_TOKENS,
    Tokenizer,
    build_tokenizer,
    default_tokenizer,
)

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  indented\n",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "Ünïcödé: naïve café, façade, Ångström, ß",
    "decomposed e\u0301 and composed é are different strings",
    "中文：模型在训练过程中会不断更新参数。日本語のテキスト。한국어 문장.",
    "العربية עברית हिन्दी ไทย",
    "emoji 🙂👍🏽🚀 family 👨‍👩‍👧‍👦 flag 🇫🇷 ✅",
    "math $\\int_0^1 x^2 dx = \\frac{1}{3}$ and \\boxed{42}",
    '{"id": "req-1", "values": [1, 2.5, -3e-7], "ok": true, "none": null}',
    "control \x00\x01\x07\x1b[31m bytes \x7f and zero-width \u200b\u200d\ufeff",
    "rare planes \U0001f9ea \U00010348 \U0010fffd",
    "byte-level alphabet look-alikes: ĠĊ ĉ Ā ł",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n4\n</think>\n4<|im_end|>",
    "specials glued<|endoftext|>to text<|im_end|><|im_start|><think></think>",
    "partial specials <|im_start <|im_end| |> <think </think",
    "x" * 500 + " " * 300 + "\n" * 50,
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_random_unicode(tok):
    rng = random.Random(0)
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 60)):
            cp = rng.choice([rng.randint(0, 127), rng.randint(128, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])
            chars.append(chr(cp))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 4096
    assert tok.eos_token_id == tok.token_to_id("<|endoftext|>") == tok.pad_token_id
    assert tok.im_start_id == tok.token_to_id("<|im_start|>")
    assert tok.im_end_id == tok.token_to_id("<|im_end|>")
    assert tok.stop_token_ids == (tok.im_end_id, tok.eos_token_id)
    for special in SPECIAL_TOKENS:
        assert tok.encode(special) == [tok.token_to_id(special)]
    assert tok.token_to_id("<|no such token|>") is None
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.im_start_id and ids[-1] == tok.im_end_id
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_encode_adds_nothing(tok):
    assert tok.encode("a") == [tok.token_to_id("a")]


def test_build_is_deterministic_and_depends_on_corpus():
    corpus = ["the quick brown fox jumps over the lazy dog\n", "def f(x):\n    return x + 1\n"] * 5
    a, b = build_tokenizer(400, corpus), build_tokenizer(400, corpus)
    assert a.backend.to_str() == b.backend.to_str()
    assert 261 < a.vocab_size <= 400  # a small corpus runs out of merges before the cap
    c = build_tokenizer(400, ["completely different text about rivers and stones\n"] * 5)
    assert c.backend.to_str() != a.backend.to_str()
    assert a.decode(a.encode("unseen: 中文 🙂")) == "unseen: 中文 🙂"


def _content(tokenizer_json: dict) -> tuple:
    """What a tokenizer.json means, not how a given `tokenizers` release serialises it."""
    model = tokenizer_json["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    added = sorted((a["id"], a["content"]) for a in tokenizer_json["added_tokens"])
    return model["vocab"], merges, added


def test_shipped_artifact_is_the_default_build():
    rebuilt = json.loads(build_tokenizer().backend.to_str())
    shipped = json.loads(DEFAULT_TOKENIZER.read_text(encoding="utf-8"))
    assert _content(rebuilt) == _content(shipped)


def test_build_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size must be >= 261"):
        build_tokenizer(100, ["abc"])


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.vocab_size == tok.vocab_size
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in config["chat_template"]


def test_chat_template_matches_render_chat(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.render_chat(messages)
    assert (
        rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("2+2?<|im_end|>\n")


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Tokenizer.load(tmp_path)
    HFTokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"lacks the ChatML token\(s\) \['<\|im_start\|>', '<\|im_end\|>'\]"):
        Tokenizer.load(tmp_path)


def test_load_qwen_style_layout(tmp_path):
    """A Qwen3 checkpoint has the specials as added tokens after the BPE vocabulary."""
    base = build_tokenizer(300, ["some text to train on\n"] * 3).backend
    qwen_like = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate("abc")}, merges=[]))
    qwen_like.pre_tokenizer, qwen_like.decoder = base.pre_tokenizer, base.decoder
    qwen_like.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    qwen_like.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.load(tmp_path)
    assert (loaded.eos_token_id, loaded.im_start_id, loaded.im_end_id) == (3, 4, 5)
    assert loaded.vocab_size == 6
