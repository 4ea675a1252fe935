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


def request_records(
    store: TrajectoryStore, session_id: str, request_ids: Iterable[str], stored: list | None = None
) -> Iterator[dict]:
    """One record per request named (the branch-record fields, for that request alone): its full sequence,
    with the prompt masked out and its own generated tokens' logprobs and versions. Unlike branches, two
    requests that sampled the same tokens stay two records (a GRPO group counts both), and a request that
    was superseded (regenerated) is simply not named. `reward` is the request's own (`meta.request_rewards`,
    as the rollout manager writes them) if there is one, else its branch's, else the session's. `stored`: the
    session's `store.records`, when the caller has read them already."""
    records = {r.request_id: r for r in (store.records(session_id) if stored is None else stored)}
    tree = store.load_tree(session_id)
    notes = store.annotations(session_id)
    branch_rewards = notes.get("branch_rewards", {})
    own = notes.get("meta", {}).get("request_rewards", {})
    branch_of = {rid: b.branch_id for b in tree.branches() for rid in b.request_ids}
    for rid in request_ids:
        if rid not in records:
            raise ValueError(f"no request {rid!r} in session {session_id!r} of {store.path}")
        r = records[rid]
        prompt = list(tree.sequence_array(r.anchor_request_id)[: r.match_len]) if r.anchor_request_id else []
        prompt += r.new_prompt_token_ids
        n = len(r.token_ids)
        yield {
            "session_id": session_id,
            "request_id": rid,
            "branch_id": branch_of[rid],
            "token_ids": prompt + list(r.token_ids),
            "generated_mask": [0] * len(prompt) + [1] * n,
            "logprobs": [None] * len(prompt) + list(r.logprobs),
            "versions": [None] * len(prompt) + list(r.versions),
            "reward": own.get(rid, branch_rewards.get(str(branch_of[rid]), notes.get("reward"))),
            "task_id": notes.get("task_id"),
            "meta": notes.get("meta", {}),
        }
