"""Is what the trainer would learn on exactly what the engine sampled?

For every stored request, the trajectory tree's copy of its generated tokens must equal the ids
the engine reported (token mismatches: must be 0). Every branch is then re-scored with a plain
`transformers` forward pass of the model, and each generated token's recorded logprob is compared
with the re-scored one (the largest difference is the engine's numerical drift; with weights that
changed since sampling it also shows the off-policy gap). For contrast, the report counts branches
whose text would *not* re-tokenise to the same ids: what a text-level proxy would have trained on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from reference.manager.store import TrajectoryStore


@dataclass(frozen=True)
class ConsistencyReport:
    sessions: int
    branches: int
    requests: int
    generated_tokens: int
    token_mismatches: int  # recorded engine ids that differ from the trajectory's ids (must be 0)
    scored_tokens: int
    max_logprob_diff: float
    mean_logprob_diff: float
    retokenize_mismatched_branches: int  # branches whose decoded text re-encodes to other ids

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.token_mismatches == 0


def check_store(
    store: TrajectoryStore,
    model,
    tokenizer,
    session_ids: Iterable[str] | None = None,
    version: int | None = None,
) -> ConsistencyReport:
    """Check `session_ids` (default: all); logprobs are compared only for tokens sampled under
    `version` when one is given (tokens of other versions were sampled by other weights)."""
    from reference.model import score_logprobs

    sessions = list(session_ids) if session_ids is not None else store.sessions()
    n_branches = n_requests = n_generated = mismatches = scored = retok = 0
    max_diff, sum_diff = 0.0, 0.0
    for sid in sessions:
        tree = store.load_tree(sid)
        for record in store.records(sid):
            n_requests += 1
            n_generated += len(record.token_ids)
            sequence = tree.sequence(record.request_id)
            tail = sequence[len(sequence) - len(record.token_ids) :]
            mismatches += sum(a != b for a, b in zip(tail, record.token_ids, strict=True))
        for branch in tree.branches():
            n_branches += 1
            if tokenizer.encode(tokenizer.decode(list(branch.token_ids))) != list(branch.token_ids):
                retok += 1
            rescored = score_logprobs(model, branch.token_ids)
            for i in range(1, len(branch.token_ids)):
                lp, v = branch.logprobs[i], branch.versions[i]
                if not branch.generated_mask[i] or lp is None or (version is not None and v != version):
                    continue
                if math.isinf(lp) and math.isinf(rescored[i - 1]):
                    continue
                diff = abs(lp - rescored[i - 1])
                max_diff, sum_diff, scored = max(max_diff, diff), sum_diff + diff, scored + 1
    return ConsistencyReport(
        sessions=len(sessions),
        branches=n_branches,
        requests=n_requests,
        generated_tokens=n_generated,
        token_mismatches=mismatches,
        scored_tokens=scored,
        max_logprob_diff=max_diff,
        mean_logprob_diff=sum_diff / scored if scored else 0.0,
        retokenize_mismatched_branches=retok,
    )
