"""The runtime's tokenizer: byte-level BPE with Qwen-style special tokens, built offline.

`Tokenizer` wraps a `tokenizers.Tokenizer` and adds what the runtime needs: the ids of the ChatML
markers, ChatML rendering and a Hugging Face layout on disk. `load` reads any local `tokenizer.json`
that has the ChatML markers as added tokens, including a real Qwen3 checkpoint's.

The default tokenizer (`default_tokenizer`) is the shipped `assets/tokenizer.json`, trained by
`build_tokenizer` on `assets/corpus.txt` (text written for this repository), so nothing is
downloaded or trained at run time. Departure from Qwen: no NFC normalizer, so `decode(encode(text))
== text` for every string, and the special tokens take the first ids (0-4) rather than the last.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS_DIR / "corpus.txt"
DEFAULT_TOKENIZER = ASSETS_DIR / "tokenizer.json"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, newlines.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class Tokenizer:
    """Token ids <-> text. `encode` adds no BOS/EOS; special-token strings in the text become their ids."""

    def __init__(self, backend: _HFTokenizer, source: str = "<memory>") -> None:
        self.backend = backend
        self.source = source
        missing = [t for t in (IM_START, IM_END) if backend.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer from {source} lacks the ChatML token(s) {missing}")

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        eos = self.backend.token_to_id(ENDOFTEXT)
        return eos if eos is not None else self.im_end_id

    @property
    def pad_token_id(self) -> int:
        return self.eos_token_id

    @property
    def im_start_id(self) -> int:
        return self.backend.token_to_id(IM_START)

    @property
    def im_end_id(self) -> int:
        return self.backend.token_to_id(IM_END)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end an assistant turn: <|im_end|> and <|endoftext|>."""
        return tuple(dict.fromkeys((self.im_end_id, self.eos_token_id)))

    def encode(self, text: str) -> list[int]:
        # encode_batch_fast gives the same ids as encode, faster, and releases the GIL while it works, so
        # tokenising a large message in a worker thread does not stall the caller's event loop.
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (special tokens included): a text of n characters is at
        least n / this many tokens, which bounds a prompt's length before it is tokenised."""
        return max(1, max(len(self.backend.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size)))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """ChatML, exactly what `CHAT_TEMPLATE` renders: one `<|im_start|>role\\ncontent<|im_end|>\\n` a message."""
        parts = [f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages]
        if add_generation_prompt:
            parts.append(f"{IM_START}assistant\n")
        return "".join(parts)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json` (eos/pad names, ChatML chat template)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        eos = self.backend.id_to_token(self.eos_token_id)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": eos,
            "pad_token": eos,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "chat_template": CHAT_TEMPLATE,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load `tokenizer.json` from a local directory (ours, or a Qwen3 checkpoint's)."""
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {Path(directory)} (expected {path})")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"{path} is not a readable tokenizer.json: {e}") from None
        return cls(backend, source=str(path))


def _untrained() -> _HFTokenizer:
    tok = _HFTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab_size: int = 4096, corpus: Iterable[str] | None = None) -> Tokenizer:
    """Train a byte-level BPE tokenizer; the same corpus and size give a byte-identical tokenizer.json.

    `vocab_size` is a cap counting the 256 byte tokens and the 5 special tokens (ids 0-4); a small corpus
    may run out of merges below it. `corpus` defaults to the shipped `assets/corpus.txt`, one training
    text per paragraph; the shipped corpus fills 4096.
    """
    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(
            f"vocab_size must be >= {floor} (256 bytes + {len(SPECIAL_TOKENS)} specials), got {vocab_size}"
        )
    texts = list(corpus) if corpus is not None else default_corpus()
    tok = _untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return Tokenizer(tok, source="build_tokenizer")


def default_corpus() -> list[str]:
    """The shipped training text, split into paragraphs."""
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    return [p + "\n" for p in text.split("\n\n") if p.strip()]


@cache
def default_tokenizer() -> Tokenizer:
    """The shipped tokenizer (loaded once per process; treat it as read-only)."""
    if not DEFAULT_TOKENIZER.is_file():
        raise FileNotFoundError(f"{DEFAULT_TOKENIZER} is missing; rebuild it with rebuild_default_tokenizer()")
    return Tokenizer(_HFTokenizer.from_file(str(DEFAULT_TOKENIZER)), source=str(DEFAULT_TOKENIZER))


def rebuild_default_tokenizer(vocab_size: int = 4096) -> Path:
    """Retrain the default tokenizer from `assets/corpus.txt` and overwrite `assets/tokenizer.json`."""
    build_tokenizer(vocab_size).backend.save(str(DEFAULT_TOKENIZER))
    default_tokenizer.cache_clear()
    return DEFAULT_TOKENIZER
