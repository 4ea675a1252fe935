"""The records of the trajectory store: a finished request to store (`NewTurn`), one as stored (`TurnRecord`),
and the checks and packing both the store and its journal apply before anything is written.

`prepare` turns a `NewTurn` into the row both write: (session_id, request_id, anchor_request_id, match_len,
num_tokens, (four little-endian blobs), (finish_reason, text, created_s, meta as JSON)). Token arrays are
little-endian blobs (uint32 ids, float64 logprobs, int32 versions), not JSON.
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_META_JSON = json.JSONEncoder(sort_keys=True, allow_nan=False).encode


@dataclass(frozen=True)
class NewTurn:
    """A finished request to store: the contract between the manager and the store. The request's prompt is
    sequence(anchor_request_id)[:match_len] + new_prompt_token_ids (see `PrefixTree.plan`)."""

    session_id: str
    request_id: str
    anchor_request_id: str | None
    match_len: int
    new_prompt_token_ids: Sequence[int]
    token_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: str
    text: str
    meta: dict[str, Any] | None = None


@dataclass(frozen=True)
class TurnRecord:
    """One finished request, as stored. seq is its position in the session (0, 1, ...), assigned by the
    store; the request's prompt is sequence(anchor_request_id)[:match_len] + new_prompt_token_ids."""

    session_id: str
    request_id: str
    seq: int
    anchor_request_id: str | None
    match_len: int
    new_prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    finish_reason: str
    text: str
    created_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return self.match_len + len(self.new_prompt_token_ids)


def pack(name: str, typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    """Values as a little-endian blob of `typecode` items."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    try:
        arr = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{name} does not fit array type {typecode!r}: {e}") from None
    if sys.byteorder == "big":
        arr = array(typecode, arr)
        arr.byteswap()
    return arr.tobytes()


def unpack(typecode: str, blob: bytes) -> array:
    arr = array(typecode)
    arr.frombytes(blob)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr


def check_name(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty str, got {value!r}")


def check_anchor(session_id: str, anchor_request_id: str, match_len: int, size: int | None) -> None:
    """An anchor must be stored in the session, with at least match_len tokens (`size`: its num_tokens)."""
    if size is None:
        raise ValueError(f"anchor_request_id {anchor_request_id!r} is not stored in session {session_id!r}")
    if match_len > size:
        raise ValueError(
            f"match_len {match_len} is longer than anchor {anchor_request_id!r}'s sequence ({size} tokens)"
        )


def _check_fields(turn: NewTurn) -> None:
    """ValueError naming the first field of `turn` that a stored record cannot hold."""
    check_name("session_id", turn.session_id)
    check_name("request_id", turn.request_id)
    match_len = turn.match_len
    if not isinstance(match_len, int) or match_len < 0:
        raise ValueError(f"match_len must be an int >= 0, got {match_len!r}")
    if (turn.anchor_request_id is None) != (match_len == 0):
        raise ValueError(f"anchor_request_id {turn.anchor_request_id!r} must be None exactly when match_len == 0")
    if match_len + len(turn.new_prompt_token_ids) == 0:
        raise ValueError("the prompt is empty: match_len == 0 and no new_prompt_token_ids")
    if not len(turn.token_ids) == len(turn.logprobs) == len(turn.versions):
        n = (len(turn.token_ids), len(turn.logprobs), len(turn.versions))
        raise ValueError(f"token_ids, logprobs and versions differ in length: {n}")
    finish_reason, text = turn.finish_reason, turn.text
    if not isinstance(finish_reason, str) or not isinstance(text, str):
        raise ValueError(f"finish_reason and text must be str, got {finish_reason!r} and {type(text).__name__}")


def prepare(turn: NewTurn) -> tuple:
    """Validate one record and pack its arrays (no database access): the row the store and the journal write."""
    _check_fields(turn)
    try:
        meta_json = "{}" if turn.meta is None else _META_JSON(turn.meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"meta must be a JSON-serialisable dict: {e}") from None
    blobs = (
        pack("new_prompt_token_ids", "I", turn.new_prompt_token_ids),
        pack("token_ids", "I", turn.token_ids),
        pack("logprobs", "d", turn.logprobs),
        pack("versions", "i", turn.versions),
    )
    num_tokens = turn.match_len + len(turn.new_prompt_token_ids) + len(turn.token_ids)
    return (
        turn.session_id,
        turn.request_id,
        turn.anchor_request_id,
        turn.match_len,
        num_tokens,
        blobs,
        (turn.finish_reason, turn.text, time.time(), meta_json),
    )


def from_row(row: tuple) -> TurnRecord:
    """The record in a row of the store's `turns` table (its columns in `schema.COLUMNS` order)."""
    session_id, seq, request_id, anchor, match_len, _, new_prompt, ids, logprobs, versions, *rest = row
    finish_reason, text, created_s, meta = rest
    return TurnRecord(
        session_id,
        request_id,
        seq,
        anchor,
        match_len,
        tuple(unpack("I", new_prompt)),
        tuple(unpack("I", ids)),
        tuple(unpack("d", logprobs)),
        tuple(unpack("i", versions)),
        finish_reason,
        text,
        created_s,
        json.loads(meta),
    )
