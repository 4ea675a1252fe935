"""Is what the trainer would learn on exactly what the engine sampled?

For every stored request, the trajectory tree's copy of its generated tokens must equal the ids
the engine reported (token mismatches: must be 0). Every branch is then re-scored with a plain
`transformers` forward pass of the model, and each generated token's recorded logprob is compared
with the re-scored one (the largest difference is the engine's numerical drift; with weights that
changed since sampling it also shows the off-policy gap). For contrast, the report counts branches
whose text would *not* re-tokenise to the same ids: what a text-level proxy would have trained on.

A training run's own store (`python -m reference train` writes OUT/trajectories.sqlite) is checked with the run's
tokenizer and, token by token, the weights of the version that sampled it (`RunWeights`, `run_of_store`), not a
serving model whose vocabulary is another; and at the run's rollout.temperature (`scoring_temperature`): the engines
record the log-probs of what they sampled from, softmax(logits / T) (`reference.engine.sampling`), or at temperature 1
where the run's engine.logprobs_mode is raw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

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
    mismatched_requests: int = 0  # requests with at least one token mismatch

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.token_mismatches == 0


Weights = Callable[[int], object | None]  # a token's policy version -> the model that sampled it (None: not kept)


def check_store(
    store: TrajectoryStore,
    model,
    tokenizer,
    session_ids: Iterable[str] | None = None,
    version: int | None = None,
    *,
    weights: Weights | None = None,
    progress: Callable[[int, int], None] | None = None,
    temperature: float = 1.0,
) -> ConsistencyReport:
    """Check `session_ids` (default: all); logprobs are compared only for tokens sampled under
    `version` when one is given (tokens of other versions were sampled by other weights).

    `model` re-scores every token; or, with `model` None, `weights(v)` gives the weights that sampled version `v`
    (a training run's own, `RunWeights`), and a token whose version has no weights is checked for its ids only.
    Tokens are re-scored under softmax(logits / `temperature`), the temperature they were sampled at.
    `progress(done, total)` is called after each session."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (what the tokens were sampled at), got {temperature!r}")
    sessions = list(session_ids) if session_ids is not None else store.sessions()
    lookup = weights if model is None else (lambda v: model)
    n_branches = n_requests = n_generated = mismatches = bad_requests = scored = retok = 0
    max_diff, sum_diff = 0.0, 0.0
    for done, sid in enumerate(sessions, 1):
        tree = store.load_tree(sid)
        for record in store.records(sid):
            n_requests += 1
            n_generated += len(record.token_ids)
            sequence = tree.sequence(record.request_id)
            tail = sequence[len(sequence) - len(record.token_ids) :]
            wrong = sum(a != b for a, b in zip(tail, record.token_ids, strict=True))
            mismatches, bad_requests = mismatches + wrong, bad_requests + (wrong > 0)
        branches = list(tree.branches())
        n_branches += len(branches)
        by_model: dict[int, tuple[object, list]] = {}  # id(model) -> (model, [(branch, versions it scores)])
        for branch in branches:
            if tokenizer.encode(tokenizer.decode(list(branch.token_ids))) != list(branch.token_ids):
                retok += 1
            wanted = {
                v
                for i, v in enumerate(branch.versions)
                if i
                and branch.generated_mask[i]
                and branch.logprobs[i] is not None
                and (version is None or v == version)
            }
            for v in sorted(wanted):
                scorer = lookup(v) if lookup is not None else None
                if scorer is not None:
                    by_model.setdefault(id(scorer), (scorer, []))[1].append((branch, v))
        for scorer, work in by_model.values():
            scores = score_batch(scorer, [b.token_ids for b, _ in work], temperature)
            for (branch, v), rescored in zip(work, scores, strict=True):
                for i in range(1, len(branch.token_ids)):
                    lp = branch.logprobs[i]
                    if not branch.generated_mask[i] or lp is None or branch.versions[i] != v:
                        continue
                    if math.isinf(lp) and math.isinf(rescored[i - 1]):
                        continue
                    diff = abs(lp - rescored[i - 1])
                    max_diff, sum_diff, scored = max(max_diff, diff), sum_diff + diff, scored + 1
        if progress is not None:
            progress(done, len(sessions))
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
        mismatched_requests=bad_requests,
    )


BATCH_TOKENS = 16384  # padded tokens a forward pass of `score_batch` takes at most


def score_batch(model, sequences: Sequence[Sequence[int]], temperature: float = 1.0) -> list[list[float]]:
    """`reference.model.score_logprobs` of each sequence (log p of tokens 1..n-1 under softmax(logits /
    `temperature`)), several in one forward pass:
    right-padded, so that causal attention keeps every real position's logits what they are alone (up to float
    rounding)."""
    import torch

    out: list[list[float] | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batch: list[int] = []

    def run() -> None:
        if batch:
            width = max(len(sequences[i]) for i in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(sequences[i])] = torch.tensor(list(sequences[i]), dtype=torch.long)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, :-1].float()
                logprobs = torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
            picked = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
            for row, i in enumerate(batch):
                out[i] = picked[row, : max(0, len(sequences[i]) - 1)].tolist()
        batch.clear()

    for i in order:
        if len(sequences[i]) < 2:
            out[i] = []
            continue
        if batch and (len(batch) + 1) * len(sequences[i]) > BATCH_TOKENS:
            run()
        batch.append(i)
    run()
    return out  # type: ignore[return-value]


SMALL_WEIGHTS_BYTES = 256 << 20  # a run's weights below this size: several versions kept loaded at once


class RunWeights:
    """A training run's weights by policy version (`OUT/weights/v<version>`, `reference.trainer.handoff`): the
    versions still kept (the run keeps the initial ones, its checkpoints' and its newest few), loaded on first use
    and cached, at most `cache` at once."""

    def __init__(self, root: Path, cache: int | None = None) -> None:
        from reference.trainer.handoff import version_dir

        self.root = Path(root)
        self.versions = sorted(
            int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit() and (p / "config.json").is_file()
        )
        self._dir = lambda v: version_dir(self.root, v)
        size = sum(f.stat().st_size for f in self._dir(self.versions[0]).glob("*.safetensors")) if self.versions else 0
        self.cache = cache if cache is not None else (8 if size < SMALL_WEIGHTS_BYTES else 1)  # a checkpoint's
        # weights (--model DIR) load one version at a time
        self._loaded: dict[int, object] = {}

    def tokenizer(self):
        from reference.tokenizer import Tokenizer

        return Tokenizer.load(self._dir(self.versions[0]))

    def __call__(self, version: int):
        if version not in self.versions:
            return None
        if version not in self._loaded:
            from reference.model import load_checkpoint

            if len(self._loaded) >= self.cache:
                self._loaded.pop(next(iter(self._loaded)))
            self._loaded[version] = load_checkpoint(self._dir(version))[0]
        return self._loaded[version]


def run_of_store(store: Path) -> Path | None:
    """The training run folder a store belongs to (`python -m reference train` writes OUT/trajectories.sqlite beside
    OUT/config.yaml and OUT/weights/), or None for another store (`serve`'s)."""
    run = Path(store).resolve().parent
    if (run / "config.yaml").is_file() and any((run / "weights").glob("v*/config.json")):
        return run
    return None


def scoring_temperature(given: float | None, run: Path | None) -> float:
    """The temperature to re-score at: `given` (check's --temperature), else a training run's rollout.temperature
    (its saved config) where its engines recorded processed log-probs, else 1 (raw log-probs, or no run). Greedy (0)
    is 1: a greedy token's log-prob is recorded at temperature 1."""
    if given is None and run is not None:
        from core.config import load_yaml
        from reference.engine.backends import logprobs_temperature

        saved = load_yaml(Path(run) / "config.yaml")
        rollout, engine = saved.get("rollout"), saved.get("engine")
        mode = engine.get("logprobs_mode", "processed") if isinstance(engine, dict) else "processed"
        given = logprobs_temperature(mode, rollout.get("temperature") if isinstance(rollout, dict) else None)
    return float(given) if isinstance(given, int | float) and given > 0 else 1.0


def verdict(report: ConsistencyReport) -> str:
    """The last line of `python -m reference check`: OK or FAILED, and the figures it rests on."""
    scored = (
        f"; {report.scored_tokens:,} tokens re-scored, largest logprob difference {report.max_logprob_diff:.2g}"
        if report.scored_tokens
        else "; no logprob re-scored"
    )
    if report.ok:
        return f"check: OK — {report.requests:,} records, 0 token mismatches{scored}"
    return (
        f"check: FAILED — {report.mismatched_requests:,} of {report.requests:,} records differ from what the "
        f"engine reported ({report.token_mismatches:,} token mismatches){scored}"
    )


PROGRESS_LINE_S = 10.0  # off a terminal: a progress line at most this often


class CheckProgress:
    """`check_store`'s progress: a bar on a terminal; elsewhere a line every PROGRESS_LINE_S seconds (a long check
    still says where it is); nothing for a check that ends sooner."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        import sys
        import time

        from tqdm import tqdm

        from core.outputs import show_progress

        self._clock, self._stderr = time.monotonic, sys.stderr
        self.bar = tqdm(total=total, desc="check", unit="session", disable=not show_progress(enabled), leave=False)
        self.lines = enabled and self.bar.disable
        self.start = self.last = self._clock()

    def __call__(self, done: int, total: int) -> None:
        self.bar.update(done - self.bar.n)
        now = self._clock()
        if self.lines and now - self.last >= PROGRESS_LINE_S:
            self.last = now
            print(
                f"check: {done:,} of {total:,} sessions ({done / total:.0%}), {now - self.start:,.0f} s",
                file=self._stderr,
                flush=True,
            )

    def __enter__(self) -> CheckProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
