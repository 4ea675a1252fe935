"""The engine protocol's wire format: generate calls as JSON, and the NDJSON lines of a generation stream.

One module for both ends, so the server (server.py) and `HTTPEngine` (client.py) cannot drift apart:

    a generate call   {"request_id", "prompt_token_ids", "params": {max_tokens, temperature, top_p,
                      stop_token_ids, seed}}: `request_to_wire` writes it, `parse_generate` reads it back,
                      validated without coercion (wrong JSON types, NaN and Infinity are errors). The prompt
                      may come as "prompt_ids_b64" instead: the ids as unsigned 32-bit little-endian
                      integers, base64-encoded (what `request_to_wire` writes: a 32,000-token prompt took
                      about 4 ms to write and 4 ms to read back as a JSON list, 1-1.5 ms each this way;
                      benchmarks/engine_wire.py)
    a stream line     {"t": [ids], "l": [logprobs], "v": [versions]} (tokens), {"finish": reason},
                      {"hb": 1} (heartbeat), {"error": message, "kind": "bad_request" | "engine"};
                      in a `/generate_many` stream each is tagged with its request's index: {"r": 0, ...}

The server writes lines with `tokens_line`, `finish_line`, `error_line` and `tagged_line`; the client reads them
with `parse_line` and `parse_tagged`, which turn an error line into `ValueError` (the request's fault) or
`EngineError`.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    TokenEvent,
)

MAX_BATCH = 4096  # requests in one /generate_many call
MAX_ABORTS = 65536  # request ids in one abort call
HEARTBEAT_LINE = b'{"hb": 1}\n'


# ---- generate calls ----


def ids_to_wire(ids: Sequence[int]) -> str:
    """Token ids as base64 of unsigned 32-bit little-endian integers (OverflowError for an id outside 0..2**32-1)."""
    packed = array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def ids_from_wire(text: Any, field: str = "prompt_ids_b64") -> tuple[int, ...]:
    """The ids `ids_to_wire` wrote; ValueError naming `field` for anything else."""
    if not isinstance(text, str):
        raise ValueError(f"{field} must be a base64 string, got {brief(text)}")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} is not valid base64: {brief(text)}") from None
    if len(raw) % 4:
        raise ValueError(f"{field} must hold 4 bytes an id, got {len(raw)} bytes")
    packed = array("I")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return tuple(packed)


def request_to_wire(request: GenerateRequest) -> dict:
    p = request.params
    try:
        prompt = {"prompt_ids_b64": ids_to_wire(request.prompt_token_ids)}
    except (OverflowError, TypeError):  # an id no vocabulary has: the engine refuses this request alone, by name
        prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
    return {
        "request_id": request.request_id,
        **prompt,
        "params": {
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stop_token_ids": list(p.stop_token_ids),
            "seed": p.seed,
        },
    }


def parse_generate(body: Any) -> GenerateRequest:
    """The wire form of a generate call, validated without coercion; ValueError names the bad field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    prompt = _prompt(body)
    p = body.get("params")
    p = {} if p is None else p
    if not isinstance(p, dict):
        raise ValueError(f"params must be a JSON object, got {brief(p)}")
    _check_param_types(p)
    try:
        params = SamplingParams(
            max_tokens=p.get("max_tokens", 16),
            temperature=p.get("temperature", 1.0),
            top_p=p.get("top_p", 1.0),
            stop_token_ids=tuple(p.get("stop_token_ids", ())),
            seed=p.get("seed"),
        )
    except ValueError as e:
        raise ValueError(f"bad sampling params: {e}") from None
    return GenerateRequest(request_id, prompt, params)


def _prompt(body: dict) -> tuple[int, ...]:
    """The prompt's ids: `prompt_token_ids` (a JSON list of integers) or `prompt_ids_b64`, exactly one."""
    listed, packed = body.get("prompt_token_ids"), body.get("prompt_ids_b64")
    if (listed is None) == (packed is None):
        raise ValueError("give the prompt as exactly one of prompt_token_ids (a list of integers) and prompt_ids_b64")
    if packed is not None:
        return ids_from_wire(packed)
    # type() rather than isinstance: a bool is not a token id; map keeps the per-id check out of Python bytecode
    if not isinstance(listed, list) or not set(map(type, listed)) <= {int}:
        raise ValueError("prompt_token_ids must be a list of integers")
    return tuple(listed)


def brief(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (an error message never echoes a whole body)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_param_types(p: dict) -> None:
    """JSON types of the sampling params, checked before their ranges (SamplingParams checks those)."""
    unknown = sorted(set(p) - set(_PARAM_TYPES))
    if unknown:
        raise ValueError(f"unknown sampling param {unknown[0]!r}; allowed: {', '.join(_PARAM_TYPES)}")
    for name, value in p.items():
        what, check = _PARAM_TYPES[name]
        if not check(value):
            raise ValueError(f"params.{name} must be {what}, got {brief(value)}")


_PARAM_TYPES = {
    "max_tokens": ("an integer", is_int),
    "temperature": ("a number", lambda v: is_int(v) or isinstance(v, float)),
    "top_p": ("a number", lambda v: is_int(v) or isinstance(v, float)),
    "stop_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(is_int(t) for t in v)),
    "seed": ("an integer or null", lambda v: v is None or is_int(v)),
}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"body is not valid JSON: {name} is not a number JSON allows")


def loads_strict(text: str) -> Any:
    """`json.loads` without NaN or Infinity, and a ValueError (not RecursionError) for too deep nesting."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise ValueError(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("body is not valid JSON: nested too deeply") from None


# ---- stream lines, written by the server ----


def token_fields(tokens: list[TokenEvent]) -> dict:
    return {"t": [t.token_id for t in tokens], "l": [t.logprob for t in tokens], "v": [t.version for t in tokens]}


def tokens_line(tokens: list[TokenEvent]) -> bytes:
    return _line(token_fields(tokens))


def finish_line(event: Finished) -> bytes:
    return _line({"finish": str(event.reason)})


def error_line(message: str, kind: str) -> bytes:
    """An error line: `kind` "bad_request" (the request's fault) or "engine" (retry elsewhere)."""
    return _line({"error": message, "kind": kind})


def tagged_line(index: int, fields: dict) -> bytes:
    """A `/generate_many` line: `fields` of one of the above, tagged with its request's index."""
    return _line({"r": index, **fields})


def _line(fields: dict) -> bytes:
    return (json.dumps(fields) + "\n").encode()


# ---- stream lines, read by the client ----


def parse_tagged(raw: bytes, where: str) -> tuple[int | None, TokenBatch | Finished | Exception | None]:
    """(request index, what the line says: a batch, the finish, or the request's own error) of a
    `/generate_many` line; (None, None) for a heartbeat. A line that cannot be read fails the stream
    (EngineError, `where` naming the engine)."""
    d = _line_object(raw, where)
    index = d.pop("r", None)
    if index is None:
        return None, _parse_object(d, raw, where)
    if not is_int(index):
        raise EngineError(f"{where}: a stream line with a bad request index: {raw[:80]!r}")
    try:
        return index, _parse_object(d, raw, where)
    except (ValueError, EngineError) as e:  # this request's error, not the stream's
        return index, e


def parse_line(raw: bytes, where: str) -> TokenBatch | Finished | None:
    """What a `/generate` line says (None: a heartbeat); an error line raises ValueError or EngineError."""
    return _parse_object(_line_object(raw, where), raw, where)


def _line_object(raw: bytes, where: str) -> dict:
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise EngineError(f"{where}: unreadable stream line {raw[:80]!r}") from e
    if not isinstance(d, dict):
        raise EngineError(f"{where}: a stream line that is not an object: {raw[:80]!r}")
    return d


def _parse_object(d: dict, raw: bytes, where: str) -> TokenBatch | Finished | None:
    if "t" in d:
        ids, logprobs, versions = d["t"], d.get("l"), d.get("v")
        if not isinstance(ids, list):
            ids, logprobs, versions = [ids], [logprobs], [versions]
        if not (
            isinstance(logprobs, list) and isinstance(versions, list) and len(ids) == len(logprobs) == len(versions)
        ):
            raise EngineError(f"{where}: a malformed token line: {raw[:80]!r}")
        return TokenBatch(ids, logprobs, versions)
    if "hb" in d:
        return None
    if "error" in d:
        if d.get("kind") == "bad_request":
            raise ValueError(d["error"])
        raise EngineError(f"{where}: {d['error']}")
    if "finish" in d:
        return Finished(FinishReason(d["finish"]))
    raise EngineError(f"{where}: an unknown stream line {raw[:80]!r}")
