"""OpenAI request bodies in, token ids out; engine output in, OpenAI response bodies out.

The chat template is Qwen-style ChatML, rendered *segment by segment*: each message is
`<|im_start|>` + tokens("{role}\\n") + tokens(content) + `<|im_end|>` + tokens("\\n"), and the
generation prompt is `<|im_start|>` + tokens("assistant\\n"). Two departures from rendering the
template to one string and tokenising it, both deliberate:

- an assistant message whose text is a completion this session generated is spliced back in as
  the exact token ids the engine sampled (and not re-tokenised), so turn k+1's prompt starts with
  turn k's prompt and completion token for token, even where the text would re-tokenise
  differently;
- each segment is tokenised on its own (and cached per session), so a long history costs nothing
  to re-render and a segment's ids never depend on its neighbours.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from reference.manager.errors import RequestError
from reference.manager.tools import call_text, parse_tool_calls, splice_key, tools_system_text, validate_tools

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
MAX_N = 64  # samples per request
MAX_INT = 2**63 - 1  # integers (seeds, token counts) must fit a signed 64-bit field


@dataclass(frozen=True)
class Sampling:
    """The sampling fields shared by chat and text completions, validated."""

    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: bool
    n: int = 1  # samples of the same prompt (each its own branch of the session)
    ignore_eos: bool = False  # stop tokens are ordinary tokens: generate exactly max_tokens (vLLM's extra field)


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict, ...]
    sampling: Sampling
    tools: tuple[dict, ...] = ()  # OpenAI function tools, rendered Qwen-style (tools.py)


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | tuple[int, ...]
    sampling: Sampling
    echo: bool


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r}", param=name)
    if value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise RequestError(f"'{name}' must be in {interval}, got {value}", param=name)
    return float(value)


def _optional_int(body: dict, name: str, minimum: int, maximum: int = MAX_INT) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer, got {value!r:.80}", param=name)
    if not minimum <= value <= maximum:
        raise RequestError(f"'{name}' must be in [{minimum}, {maximum}], got {str(value)[:40]}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    return tuple(stop)


def parse_sampling(body: dict, *, logprobs_flag: bool) -> Sampling:
    n = _optional_int(body, "n", 1) or 1
    if n > MAX_N:
        raise RequestError(f"'n' must be at most {MAX_N}, got {n}", param="n")
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be a boolean, got {stream!r}", param="stream")
    if stream and n > 1:
        raise RequestError("'stream' with 'n' > 1 is not supported; stream n requests instead", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", param="stream_options")
    logprobs = body.get("logprobs", False if logprobs_flag else None)
    if logprobs_flag and not isinstance(logprobs, bool):
        raise RequestError(f"'logprobs' must be a boolean, got {logprobs!r}", param="logprobs")
    if not logprobs_flag and logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise RequestError(f"'logprobs' must be an integer, got {logprobs!r}", param="logprobs")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(f"'ignore_eos' must be a boolean, got {ignore_eos!r:.80}", param="ignore_eos")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stop=_stop(body),
        seed=_optional_int(body, "seed", 0),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        logprobs=bool(logprobs),
        n=n,
        ignore_eos=ignore_eos,
    )


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {model!r}", param="model")
    return model


def message_text(message: dict, index: int) -> str:
    """A message's content as one string (text parts joined); tool calls rendered Qwen-style."""
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{index}].content: only text parts are supported, got {part!r:.80}",
                    param=f"messages[{index}].content",
                )
            parts.append(part["text"])
        text = "".join(parts)
    else:
        raise RequestError(
            f"messages[{index}].content must be a string, a list of text parts or null", param="messages"
        )
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise RequestError(f"messages[{index}].tool_calls must be a list", param="messages")
        text += ("\n" if text else "") + call_text(calls)
    return text


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", param="messages")
        if m.get("role") not in ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.get('role')!r}", param="messages"
            )
        message_text(m, i)  # validates the content
    tools = validate_tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none"):
        raise RequestError(
            f"'tool_choice' {choice!r} is not supported (no constrained decoding); use 'auto' or 'none'",
            param="tool_choice",
        )
    sampling = parse_sampling(body, logprobs_flag=True)
    if sampling.seed is not None:
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        sampling = replace(sampling, seed=turn_seed(sampling.seed, turn))
    return ChatRequest(_model(body), tuple(messages), sampling, tools if choice == "auto" else ())


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a conversation's `turn`-th reply (the assistant messages before it) when the
    request names `seed`: the seed itself for the first reply, a hash of both after it. An agent that sends
    one seed with every call (mini-swe-agent's model_kwargs) then draws different numbers on each turn, and
    the same conversation with the same seed is sampled the same way, as OpenAI's `seed` promises (an
    evaluation that fixes each episode's seed sees the same draws before and after training)."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # in [0, 2**63 - 1], the engines' range


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError("'prompt' must be a string or a non-empty list of token ids", param="prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt)", param="prompt")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError(f"'echo' must be a boolean, got {echo!r}", param="echo")
    return CompletionRequest(_model(body), prompt, parse_sampling(body, logprobs_flag=False), echo)


def encode_text(tokenizer, text: str) -> list[int]:
    """The ids of `text`; a 400 when this model's tokenizer cannot encode it (a small task vocabulary)."""
    try:
        return tokenizer.encode(text)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for text outside its vocabulary
        raise RequestError(
            f"this model's tokenizer cannot encode the text {text[:60]!r}: {e}", code="unencodable_text"
        ) from None


class ChatRenderer:
    """Renders one session's chat requests to token ids (see the module docstring).

    Memory: segment ids are cached per session up to `max_cached_tokens`; `render` keeps the segments it
    tokenised aside, and only `commit` (called once the request is accepted) adds them to the cache, so a
    rejected request leaves nothing behind. Ids are kept as array('I'), 4 bytes a token."""

    def __init__(self, tokenizer, max_cached_tokens: int = 1 << 18) -> None:
        self.tok = tokenizer
        self.max_cached_tokens = max_cached_tokens
        self._segments: dict[str, array] = {}  # text -> token ids (this session's cache)
        self._generated: dict[str, array] = {}  # completion text -> the ids the engine sampled
        self.segment_tokens = self.generated_tokens = 0
        self._generation_prompt: array | None = None  # built on first use: a completions-only tokenizer has no roles

    @property
    def generation_prompt(self) -> array:
        if self._generation_prompt is None:
            self._generation_prompt = array("I", [self.tok.im_start_id, *encode_text(self.tok, "assistant\n")])
        return self._generation_prompt

    @property
    def tokens_held(self) -> int:
        return self.segment_tokens + self.generated_tokens

    def _encode(self, text: str, fresh: dict[str, array]) -> array:
        ids = self._segments.get(text)
        if ids is None:
            ids = fresh.get(text)
            if ids is None:
                ids = fresh[text] = array("I", encode_text(self.tok, text)) if text else array("I")
        return ids

    def commit(self, fresh: dict[str, array]) -> None:
        """Cache the segments an accepted request tokenised (while the cache has room)."""
        for text, ids in fresh.items():
            if self.segment_tokens + len(ids) > self.max_cached_tokens:
                return
            if text not in self._segments:
                self._segments[text] = ids
                self.segment_tokens += len(ids)

    def remember(self, text: str, token_ids: Sequence[int]) -> None:
        """Record that this session's agent was answered `text` (the raw completion), sampled as
        `token_ids`; found again whether the agent sends back the text or its parsed tool calls."""
        ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
        content, calls = parse_tool_calls(text)
        for key in (text, splice_key(content, calls)) if calls else (text,):
            old = self._generated.get(key)
            self._generated[key] = ids
            self.generated_tokens += len(ids) - (len(old) if old is not None else 0)

    def render(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[int]:
        """Token ids of a chat request; its new segments are cached at once (see `render_pending`)."""
        ids, fresh = self.render_pending(messages, tools)
        self.commit(fresh)
        return ids

    def render_pending(self, messages: Sequence[dict], tools: Sequence[dict] = ()) -> tuple[list[int], dict]:
        """(token ids, the segments tokenised for them that the cache lacks: pass to `commit` to keep them)."""
        ids: list[int] = []
        fresh: dict[str, array] = {}
        indexed = list(enumerate(messages))
        if tools:  # the tools block joins (or becomes) the system message, as Qwen's template does
            first_system = indexed and indexed[0][1]["role"] == "system"
            system = message_text(indexed[0][1], 0) if first_system else None
            self._turn(ids, fresh, "system", self._encode(tools_system_text(tuple(tools), system), fresh))
            indexed = indexed[1:] if first_system else indexed
        k = 0
        while k < len(indexed):
            i, m = indexed[k]
            if m["role"] == "tool":  # consecutive tool results are one user turn of <tool_response> blocks
                body: list[int] = []
                while k < len(indexed) and indexed[k][1]["role"] == "tool":
                    j, t = indexed[k]
                    body += [
                        *self._encode("\n<tool_response>\n", fresh),
                        *self._encode(message_text(t, j), fresh),
                        *self._encode("\n</tool_response>", fresh),
                    ]
                    k += 1
                self._turn(ids, fresh, "user", body, header_newline=False)
                continue
            content, spliced = self._content_ids(m, i, fresh)
            self._turn(ids, fresh, m["role"], content, spliced=spliced)
            k += 1
        ids.extend(self.generation_prompt)
        return ids, fresh

    def _content_ids(self, m: dict, index: int, fresh: dict) -> tuple[Sequence[int], bool]:
        """A message's content tokens, and whether they are an assistant turn this session sampled
        (spliced back as its exact ids)."""
        text = message_text(m, index)
        if m["role"] == "assistant":
            content = message_text({"content": m.get("content")}, index)
            spliced = self._generated.get(splice_key(content, m.get("tool_calls")))  # == text without calls
            if spliced is not None:
                return spliced, True
        return self._encode(text, fresh), False

    def _turn(
        self,
        ids: list[int],
        fresh: dict,
        role: str,
        content: Sequence[int],
        header_newline: bool = True,
        spliced: bool = False,
    ) -> None:
        """<|im_start|>role\n content <|im_end|>\n; a spliced completion that stopped on <|im_end|> has it."""
        ids.append(self.tok.im_start_id)
        ids.extend(self._encode(f"{role}\n" if header_newline else role, fresh))
        ids.extend(content)
        if not (spliced and content and content[-1] == self.tok.im_end_id):
            ids.append(self.tok.im_end_id)
        ids.extend(self._encode("\n", fresh))


class IncrementalDecoder:
    """Text of a growing token list, emitted piecewise; holds back an incomplete UTF-8 character.

    Decodes a short window (the last emitted piece plus new tokens), not the whole list, so a long
    generation costs O(tokens), the way inference servers do it.
    """

    def __init__(self, tokenizer, skip_ids: Sequence[int] = ()) -> None:
        self.tok, self.skip = tokenizer, set(skip_ids)
        self.ids: list[int] = []
        self._prefix = self._read = 0  # window start; end of what has been emitted
        self.text = ""  # emitted so far

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self._prefix : self._read])
        after = self.tok.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self._prefix : self._read])
        piece = self.tok.decode(self.ids[self._prefix :])[len(before) :]
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index where the earliest stop string begins in text[start:], or -1."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float]) -> dict:
    content = []
    for t, lp in zip(token_ids, logprobs, strict=True):
        piece = tokenizer.decode([t])
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
    return {"content": content}
