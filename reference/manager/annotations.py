"""Session annotations (rewards, task id, metadata) as sent by a grader: validated at the boundary.

Annotations decide what the trainer learns, so every write is kept in the session's history (who wrote
what, when) rather than silently replacing the last one; the merged view is what readers get.
"""

from __future__ import annotations

import json
import math

from reference.manager.errors import RequestError

ANNOTATION_KEYS = ("reward", "branch_rewards", "task_id", "meta", "author")
MAX_META_BYTES = 64 << 10
MAX_AUTHOR_CHARS = 128


def _finite(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"'{name}' must be a finite number, got {value!r:.80}", param=name)
    return float(value)


def readable(text: str) -> str:
    """`text` with each lone surrogate (a header's bytes that are not UTF-8, or a JSON string's unpaired
    `\\ud800`) replaced by U+FFFD, so that it can be stored and sent back as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)
    return text


def check_annotations(body) -> tuple[dict, str]:
    """(updates, author) of an annotation body: reward (number or null), branch_rewards ({branch id:
    number}), task_id (string), meta (object of at most 64 KiB as JSON), author (who grades: a string)."""
    if not isinstance(body, dict) or not body:
        raise RequestError(f"the body must be a non-empty object with some of {', '.join(ANNOTATION_KEYS)}")
    unknown = sorted(set(body) - set(ANNOTATION_KEYS))
    if unknown:
        raise RequestError(
            f"unknown annotation {unknown[0]!r:.80}; allowed: {', '.join(ANNOTATION_KEYS)}", param=unknown[0][:80]
        )
    out = {k: v for k, v in body.items() if k != "author"}
    author = body.get("author", "")
    if not isinstance(author, str) or len(author) > MAX_AUTHOR_CHARS:
        raise RequestError(f"'author' must be a string of at most {MAX_AUTHOR_CHARS} characters", param="author")
    if not out:
        raise RequestError("nothing to annotate: give some of reward, branch_rewards, task_id, meta")
    if body.get("reward") is not None:
        out["reward"] = _finite(body["reward"], "reward")
    if "branch_rewards" in body:
        rewards = body["branch_rewards"]
        if not isinstance(rewards, dict) or not all(k.isdigit() and len(k) < 10 for k in rewards):
            raise RequestError("'branch_rewards' must map branch ids to numbers", param="branch_rewards")
        out["branch_rewards"] = {str(int(k)): _finite(v, f"branch_rewards[{k}]") for k, v in rewards.items()}
    if "task_id" in body and not isinstance(body["task_id"], str):
        raise RequestError(f"'task_id' must be a string, got {body['task_id']!r:.80}", param="task_id")
    if "meta" in body:
        if not isinstance(body["meta"], dict):
            raise RequestError("'meta' must be an object", param="meta")
        try:
            size = len(json.dumps(body["meta"], allow_nan=False))
        except (ValueError, RecursionError) as e:
            raise RequestError(f"'meta' is not storable JSON: {e}", param="meta") from None
        if size > MAX_META_BYTES:
            raise RequestError(f"'meta' is {size} bytes as JSON; at most {MAX_META_BYTES}", param="meta")
    return out, author
