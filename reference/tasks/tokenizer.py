"""A character-level tokenizer for the arithmetic tasks: one token per character, built in code.

With the runtime's 4,096-token BPE vocabulary a randomly initialised policy almost never emits a
digit, so learning from scratch spends most of its time discovering the answer's alphabet. This
tokenizer has 22 ids: the runtime's five special tokens first (ids 0-4, as in the default tokenizer:
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`), then the characters of
`ALPHABET`. It is a `reference.tokenizer.Tokenizer`, so the engines and the trajectory manager take
it like any other; it is deterministic (the same code gives a byte-identical tokenizer.json).

Text outside the alphabet cannot be encoded (the backend raises), so it suits raw prompts, not ChatML
chat rendering (role names are letters).
"""

from __future__ import annotations

from functools import cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from reference.tokenizer import SPECIAL_TOKENS, Tokenizer

ALPHABET = "0123456789+-*=> \n"
_UNKNOWN = "[UNK]"  # deliberately absent from the vocabulary: unknown characters are refused


def char_tokenizer(alphabet: str = ALPHABET) -> Tokenizer:
    """One id per special token (0-4), then one per character of `alphabet`, in order."""
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet must be non-empty with no repeated character, got {alphabet!r}")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *alphabet])}
    backend = _HFTokenizer(models.WordLevel(vocab, unk_token=_UNKNOWN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return Tokenizer(backend, source="char_tokenizer")


@cache
def task_tokenizer() -> Tokenizer:
    """The arithmetic tasks' tokenizer (built once per process; treat it as read-only)."""
    return char_tokenizer()
