"""Export stored trajectories as JSON Lines, one branch per line, for any trainer to read.

Each line: session_id, branch_id, token_ids, generated_mask (train on these), logprobs and versions
(null for prompt tokens), request_ids, and the session's annotations: reward (the branch's own, else
the session's, else null), task_id, meta. The ids are exactly those the engines consumed and
produced; nothing is re-tokenised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from reference.manager.store import TrajectoryStore


def branch_records(store: TrajectoryStore, session_ids: Iterable[str] | None = None) -> Iterator[dict]:
    """One dict per branch of each session (default: every session, in the order they were created)."""
    for sid in session_ids if session_ids is not None else store.sessions():
        if not store.has_session(sid):
            raise ValueError(f"no session {sid!r} in {store.path}")
        notes = store.annotations(sid)
        branch_rewards = notes.get("branch_rewards", {})
        for branch in store.load_tree(sid).branches():
            record = {"session_id": sid, **branch.to_json()}
            record["reward"] = branch_rewards.get(str(branch.branch_id), notes.get("reward"))
            record["task_id"] = notes.get("task_id")
            record["meta"] = notes.get("meta", {})
            yield record


def export_jsonl(
    store: TrajectoryStore, out: str | Path, session_ids: Iterable[str] | None = None, rewarded_only: bool = False
) -> int:
    """Write the branches to `out` (JSON Lines); returns how many were written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with out.open("w", encoding="utf-8") as f:
        for record in branch_records(store, session_ids):
            if rewarded_only and record["reward"] is None:
                continue
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count
