"""A training run's outputs: the simulator's (summary.json, intervals.json, timeline.json, timeline.png, all
from `core`), plus metrics.jsonl (one line per step, and one per held-out evaluation), reward.png and the
resolved config.yaml; and the progress display (a bar on a terminal, a line a step elsewhere, and optionally
TensorBoard or W&B: `logging_to`) and the end-of-run table.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import yaml
from tqdm import tqdm

from core.metrics import summarize
from core.outputs import show_progress
from core.plot import draw_timeline, run_headline
from core.run_log import EVAL_PREFIX, ScalarLog, mean_lag, scalars, step_line
from core.timeline import Timeline
from core.trace import write_chrome_trace


class MetricsLog:
    """metrics.jsonl, written as the run goes (one JSON object a line), and kept in memory."""

    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if not append:
            self.path.write_text("")
        self.steps: list[dict] = []
        self.evaluations: list[dict] = []
        self.warm_start_steps: list[dict] = []
        self.counters: dict[str, float] = {}
        self.clock_zero_epoch_s: float | None = None  # the Unix time of the run clock's zero (timeline times follow it)

    def step(self, record: dict) -> None:
        self.steps.append(record)
        self._write({"kind": "step", **record})

    def warm_start(self, record: dict) -> None:
        """One step of the supervised warm start (`reference.control.warm_start`)."""
        self.warm_start_steps.append(record)
        self._write({"kind": "warm_start", **record})

    def held_out(self, step: int, result: dict) -> None:
        """An evaluation after `step` steps; its scores also go to the active ScalarLog (`logging_to`), if any,
        as `eval/...` at that step."""
        record = {"step": step, **result}
        self.evaluations.append(record)
        self._write({"kind": "held_out", **record})
        scores = {k: result[k] for k in EVALUATION_SCORES if isinstance(result.get(k), int | float)}
        if _ACTIVE_LOG is not None and scores:
            _ACTIVE_LOG.log(step, scores, prefix=EVAL_PREFIX)

    def _write(self, record: dict) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_finite(record), sort_keys=True, allow_nan=False) + "\n")


def _finite(value):
    """`value` with every NaN or infinity (a step with no trained token has no per-token figures) made null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_ACTIVE_LOG: ScalarLog | None = None  # where Progress (not given a log) and the evaluations send their scalars


@contextmanager
def logging_to(log: ScalarLog | None) -> Iterator[ScalarLog | None]:
    """Within the block, every Progress (the training run's) sends its steps' scalars to `log` (TensorBoard,
    W&B: core/run_log.py), which is closed at the end. None: nothing beyond the bar or the lines."""
    global _ACTIVE_LOG
    previous, _ACTIVE_LOG = _ACTIVE_LOG, log
    try:
        yield log
    finally:
        _ACTIVE_LOG = previous
        if log is not None:
            log.close()


class Progress:
    """A progress bar per training step, with reward and generated tokens trained per second, on a terminal;
    elsewhere (a log file, nohup, a batch scheduler, a pipe) one plain line a step (`core.run_log.step_line`:
    step, reward, the run's generated tokens trained per second so far, the step's mean staleness, seconds since
    the run's start), so a long run still says where it is. Each step's numbers also go to the active ScalarLog
    (`logging_to`), if any, with --quiet too: the record's, `gen_tokens_per_s` (the bar's and the line's rate)
    and `staleness_mean`."""

    def __init__(self, steps: int, enabled: bool = True, done: int = 0, log: ScalarLog | None = None) -> None:
        self.bar = tqdm(
            total=steps, initial=done, desc="train", unit="step", disable=not show_progress(enabled), leave=False
        )
        self.lines, self.steps, self.done = enabled and self.bar.disable, steps, done
        self.log = log if log is not None else _ACTIVE_LOG
        self.trained_tokens = 0

    def update(self, record: dict) -> None:
        self.done += 1
        self.trained_tokens += record.get("trained_tokens", 0)  # generated tokens in the loss
        elapsed = record.get("time_s", 0.0)
        throughput = self.trained_tokens / elapsed if elapsed > 0 else 0.0
        self.bar.set_postfix(reward=f"{record['reward_mean']:.3f}", gen_tok_s=f"{throughput:,.0f}")
        self.bar.update(1)
        staleness = mean_lag(record.get("staleness") or {})
        if self.lines:
            line = step_line(self.done, self.steps, record["reward_mean"], throughput, staleness, elapsed)
            print(line, file=sys.stderr, flush=True)
        if self.log is not None:
            figures = {**scalars(record), "gen_tokens_per_s": throughput, "staleness_mean": staleness}
            self.log.log(self.done, figures)

    def note(self, text: str) -> None:
        """One line about what the run does between steps (an evaluation): above the bar on a terminal, plain
        elsewhere; nothing when progress is off."""
        if self.lines:
            print(text, file=sys.stderr, flush=True)
        elif not self.bar.disable:
            self.bar.write(text, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def write_outputs(timeline: Timeline, metrics: MetricsLog, config: dict, out: Path, picture: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(timeline)
    summary["training"] = training_summary(metrics)
    labels, rows = instance_rows(metrics)
    if rows:
        write_instances(labels, rows, out / "instances.csv")
    (out / "summary.json").write_text(json.dumps(_finite(summary), indent=2, sort_keys=True) + "\n")
    timeline.save(out / "intervals.json")
    write_chrome_trace(timeline, out / "timeline.json")
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if picture:
        draw_run_timeline(timeline, summary, out / "timeline.png")
        temperature = config.get("rollout", {}).get("temperature")  # pass@1 depends on it: say it
        sampled = f", sampled at temperature {temperature:g}" if isinstance(temperature, int | float) else ""
        draw_rewards(metrics, out / "reward.png", f"{summary['policy']}, {timeline.meta['workload']}{sampled}")
    return summary


WINDOW_STEPS = 10  # a long run's picture shows this many steps from its middle (the whole run would be a blur)


def draw_run_timeline(timeline: Timeline, summary: dict, path: Path):
    """timeline.png: the run (or, for a long one, WINDOW_STEPS steps from its middle, on the run's own clock),
    titled with the whole run's throughput and idle shares; returns the Figure."""
    shown, start_s, note = steady_window(timeline)
    n = len({iv.resource for iv in timeline.intervals})
    head = f"{summary['policy']} (measured), {timeline.meta['workload']}, {n} resource{'s' * (n != 1)}{note}"
    whole = "the whole run: " if note else ""
    return draw_timeline(shown, path, f"{head}\n{whole}{run_headline(summary)}", start_s=start_s)


def steady_window(timeline: Timeline) -> tuple[Timeline, float, str]:
    """The timeline to draw, where its time axis starts, and a title note: the whole run (from 0), or
    WINDOW_STEPS steps from its middle, clipped to them (token counts prorated) and kept at the run's times:
    the window's wall_s is where it ends."""
    steps = sorted(timeline.steps, key=lambda st: st.step)
    if len(steps) <= 2 * WINDOW_STEPS:
        return timeline, 0.0, ""
    first = len(steps) // 2 - WINDOW_STEPS // 2
    t0, t1 = steps[first - 1].end_s, steps[first + WINDOW_STEPS - 1].end_s
    intervals = []
    for iv in timeline.intervals:
        start, end = max(iv.start_s, t0), min(iv.end_s, t1)
        if end > start or (end == start and t0 < iv.start_s < t1):
            share = (end - start) / (iv.end_s - iv.start_s) if iv.end_s > iv.start_s else 1.0
            intervals.append(replace(iv, start_s=start, end_s=end, tokens=round(iv.tokens * share)))
    shown = [replace(st, start_s=max(t0, st.start_s)) for st in steps[first : first + WINDOW_STEPS]]
    sandboxes = [
        replace(sb, start_s=max(sb.start_s, t0), end_s=min(sb.end_s, t1))
        for sb in timeline.sandboxes
        if sb.end_s > t0 and sb.start_s < t1
    ]
    window = Timeline(intervals, shown, t1, dict(timeline.meta), dict(timeline.counters), sandboxes)
    note = f": steps {steps[first].step}-{steps[first + WINDOW_STEPS - 1].step} of {len(steps)}"
    return window, t0, note


EVALUATION_SCORES = ("reward_mean", "exact_match", "train_reward_mean", "train_exact_match")
EVALUATION_KEYS = ("label", "step", "time_s", *EVALUATION_SCORES)


def training_summary(metrics: MetricsLog) -> dict:
    steps, evals = metrics.steps, metrics.evaluations
    first, last = (steps[0], steps[-1]) if steps else ({}, {})
    return {
        "steps": len(steps),
        "reward_first_step": first.get("reward_mean"),
        "reward_last_step": last.get("reward_mean"),
        "held_out_first": evals[0]["reward_mean"] if evals else None,
        "held_out_last": evals[-1]["reward_mean"] if evals else None,
        "evaluations": [{k: e[k] for k in EVALUATION_KEYS if k in e} for e in evals],
        "warm_start_steps": len(metrics.warm_start_steps),
        "warm_start_loss_last": metrics.warm_start_steps[-1]["loss"] if metrics.warm_start_steps else None,
        "first_step_reaching_0.8": next((s["step"] for s in steps if s["reward_mean"] >= 0.8), None),
    }


def instance_rows(metrics: MetricsLog) -> tuple[list[str], list[tuple[str, str, list]]]:
    """Each evaluated problem's success at every evaluation of the run: the evaluations' labels (start, v4, ...,
    end), and rows (split, problem id, [(reward sum, episodes with a verdict) or None per label]); empty when the
    evaluations did not record their problems."""
    evals = [e for e in metrics.evaluations if isinstance(e.get("instances"), dict)]
    labels = [str(e.get("label", e["step"])) for e in evals]
    cells: dict[tuple[str, str], dict[int, tuple]] = {}
    for i, e in enumerate(evals):
        for split, key in (("train", "train_instances"), ("held-out", "instances")):
            for pid, (total, judged) in (e.get(key) or {}).items():
                cells.setdefault((split, pid), {})[i] = (total, judged)
    rows = [(split, pid, [got.get(i) for i in range(len(evals))]) for (split, pid), got in cells.items()]
    rows.sort(key=lambda r: (r[0] != "train", r[1]))
    return labels, rows


def write_instances(labels: list[str], rows: list, path: Path) -> None:
    """instances.csv: one row a problem, its split, and its mean reward (pass@1 for a 0/1 reward) at each
    evaluation, with the episodes it is over."""
    import csv

    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["split", "instance", *(f"{lab} {col}" for lab in labels for col in ("pass@1", "episodes"))])
        for split, pid, got in rows:
            w.writerow([split, pid, *(v for c in got for v in _cell(c))])


def _rate(c) -> float | None:
    """A cell's mean reward: (reward sum, episodes with a verdict) -> their ratio; None without a verdict."""
    return None if c is None or not c[1] else c[0] / c[1]


def _cell(c) -> tuple:
    rate = _rate(c)
    return ("", "") if rate is None else (round(rate, 4), c[1])


def instance_table(metrics: MetricsLog, first: str = "start", last: str = "end") -> str:
    """The end-of-run table of a task evaluated on its problems (SWE): each problem's pass@1 at the start of RL
    and at the end, and how many of each split changed; empty when there is nothing to show."""
    labels, rows = instance_rows(metrics)
    if first not in labels or last not in labels:
        return ""
    a, b = labels.index(first), labels.index(last)
    width = max(len(pid) for _, pid, _ in rows)
    lines = [f"{'split':<8}  {'instance':<{width}}  {first:>14}  {last:>14}"]
    for split, pid, got in rows:
        lines.append(f"{split:<8}  {pid:<{width}}  {_show(got[a]):>14}  {_show(got[b]):>14}")
    for split in ("train", "held-out"):
        pairs = [(_rate(got[a]), _rate(got[b])) for s, _, got in rows if s == split]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if pairs:
            up, down = sum(y > x for x, y in pairs), sum(y < x for x, y in pairs)
            before, after = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
            lines.append(
                f"{split}: pass@1 {before:.3f} -> {after:.3f} over {len(pairs)} problems ({up} up, {down} down)"
            )
    return "\n".join(lines)


def _show(c) -> str:
    rate = _rate(c)
    return "-" if rate is None else f"{rate:.2f} ({c[0]:g}/{c[1]})"


def _per_task(k: int) -> str:
    return f" ({k} episodes a task)" if k > 1 else " (one episode a task)"


def draw_rewards(metrics: MetricsLog, path: Path, label: str) -> None:
    """Reward over the run's wall time: the training steps' mean reward and the evaluations; for a task that is
    also evaluated on its training problems (pass@1 of SWE tasks), both splits' success rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    steps = metrics.steps
    ax.plot(
        [s["time_s"] for s in steps],
        [s["reward_mean"] for s in steps],
        linewidth=0.9,
        label="training reward (mean of the step's samples)",
    )
    evals = sorted(metrics.evaluations, key=lambda e: e["time_s"])
    if evals and "train_exact_match" in evals[0]:
        held = evals[-1].get("samples", 1)
        train = evals[-1].get("train_samples", held)
        ax.plot(
            [e["time_s"] for e in evals],
            [e["train_exact_match"] for e in evals],
            marker="o",
            linestyle="--",
            label=f"pass@1, train split{_per_task(train)}",
        )
        ax.plot(
            [e["time_s"] for e in evals],
            [e["exact_match"] for e in evals],
            marker="s",
            linestyle="--",
            label=f"pass@1, held-out split{_per_task(held)}",
        )
    elif evals:
        ax.plot(
            [e["time_s"] for e in evals],
            [e["reward_mean"] for e in evals],
            marker="s",
            linestyle="--",
            label="held-out reward",
        )
        ax.axhline(0.8, color="grey", linewidth=0.8, linestyle=":")
        ax.text(0, 0.81, "0.8", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel("wall time of the RL run (s, measured; the warm start before it not included)")
    ax.set_ylabel("reward (task's grader, 0 to 1)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{label}: reward over time")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
