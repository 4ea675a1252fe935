"""The one function that turns a timeline into metrics.

`summarize` is the only scorer: the simulator and the real runtime both hand it a `Timeline`, so
their numbers are comparable by construction. Pure Python (no numpy): percentiles use the same
linear interpolation as numpy's default, and sums use `math.fsum`, which is exactly rounded and so
independent of interval order. Before anything is computed, each resource's intervals must tile
[0, wall_s]; a gap or an overlap is an executor bug and raises `ValueError` naming the resource.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from core.tags import Phase
from core.timeline import Interval, Timeline

TOLERANCE_S = 1e-6  # how far one interval's start may sit from the previous one's end


def pool_of(interval: Interval) -> str:
    """The pool an interval's resource belongs to, named by its capability tags: "rollout+train"."""
    return "+".join(interval.tags)


def natural_key(name: str) -> tuple:
    """Sort key that orders "gpu2" before "gpu10"."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def resources_by_pool(timeline: Timeline) -> dict[str, list[str]]:
    """Pools in sorted order, each with its resources in natural order."""
    pools: dict[str, set[str]] = defaultdict(set)
    for iv in timeline.intervals:
        pools[pool_of(iv)].add(iv.resource)
    return {pool: sorted(pools[pool], key=natural_key) for pool in sorted(pools)}


def check_conservation(timeline: Timeline) -> None:
    """Raise ValueError unless every resource's intervals tile [0, wall_s] without gap or overlap."""
    by_resource: dict[str, list[Interval]] = defaultdict(list)
    for iv in timeline.intervals:
        if iv.end_s < iv.start_s:
            raise ValueError(f"resource {iv.resource!r}: interval ends at {iv.end_s} before it starts at {iv.start_s}")
        by_resource[iv.resource].append(iv)
    for resource in sorted(by_resource):
        ivs = sorted(by_resource[resource], key=lambda iv: (iv.start_s, iv.end_s))
        cursor = 0.0
        for iv in ivs:
            _check_joint(resource, cursor, iv.start_s)
            cursor = iv.end_s
        if abs(cursor - timeline.wall_s) > TOLERANCE_S:
            raise ValueError(
                f"resource {resource!r}: intervals end at {cursor} but wall_s is {timeline.wall_s} "
                f"(gap of {timeline.wall_s - cursor:.9g} s)"
            )


def _check_joint(resource: str, prev_end_s: float, start_s: float) -> None:
    delta = start_s - prev_end_s
    if delta > TOLERANCE_S:
        raise ValueError(f"resource {resource!r}: gap of {delta:.9g} s from {prev_end_s} to {start_s}")
    if delta < -TOLERANCE_S:
        raise ValueError(f"resource {resource!r}: overlap of {-delta:.9g} s at {start_s} (previous ends {prev_end_s})")


def device_seconds_by_phase(timeline: Timeline) -> dict[Phase, float]:
    """Device-seconds (duration x devices) spent in each phase, every phase present."""
    parts: dict[Phase, list[float]] = {phase: [] for phase in Phase}
    for iv in timeline.intervals:
        parts[iv.phase].append((iv.end_s - iv.start_s) * iv.devices)
    return {phase: math.fsum(values) for phase, values in parts.items()}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as numpy's default."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def step_durations(timeline: Timeline) -> list[float]:
    """Time between consecutive step ends; the first step is measured from 0."""
    ends = [step.end_s for step in timeline.steps]
    return [end - prev for prev, end in zip([0.0, *ends][:-1], ends, strict=True)]


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _step_time(timeline: Timeline) -> dict:
    durations = step_durations(timeline)
    mean = math.fsum(durations) / len(durations) if durations else 0.0
    return {
        "mean": round(mean, 6),
        "p50": round(percentile(durations, 50), 6),
        "p99": round(percentile(durations, 99), 6),
    }


def _pool_utilisation(timeline: Timeline) -> dict[str, float]:
    busy: dict[str, list[float]] = defaultdict(list)
    total: dict[str, list[float]] = defaultdict(list)
    for iv in timeline.intervals:
        seconds = (iv.end_s - iv.start_s) * iv.devices
        total[pool_of(iv)].append(seconds)
        if iv.phase is not Phase.IDLE:
            busy[pool_of(iv)].append(seconds)
    return {pool: round(_ratio(math.fsum(busy[pool]), math.fsum(total[pool])), 6) for pool in sorted(total)}


def _staleness(timeline: Timeline) -> dict:
    hist: dict[int, int] = defaultdict(int)
    for step in timeline.steps:
        for lag, tokens in step.lag_tokens.items():
            hist[int(lag)] += tokens
    weight = sum(hist.values())
    mean = _ratio(sum(lag * tokens for lag, tokens in hist.items()), weight)
    return {
        "histogram": {str(lag): hist[lag] for lag in sorted(hist)},
        "max_lag": max((lag for lag, tokens in hist.items() if tokens > 0), default=0),
        "mean_lag": round(mean, 6),
    }


def sync_durations(timeline: Timeline) -> list[float]:
    """One duration per weight-sync operation: sync intervals grouped by (step, start_s)."""
    groups: dict[tuple[int, float], list[Interval]] = defaultdict(list)
    for iv in timeline.intervals:
        if iv.phase is Phase.SYNC:
            groups[(iv.step, iv.start_s)].append(iv)
    return [max(iv.end_s for iv in ivs) - min(iv.start_s for iv in ivs) for _, ivs in sorted(groups.items())]


def _sync_time(timeline: Timeline) -> dict:
    durations = sync_durations(timeline)
    total = math.fsum(durations)
    return {"mean": round(_ratio(total, len(durations)), 6), "total": round(total, 6), "count": len(durations)}


def _rollout_rate(timeline: Timeline, rollout_device_s: float) -> float:
    """Tokens generated per device-second of rollout: how well busy rollout devices were used
    (a device decoding one straggler counts as busy but yields little)."""
    generated = sum(iv.tokens for iv in timeline.intervals if iv.phase is Phase.ROLLOUT)
    return _ratio(generated, rollout_device_s)


def summarize(timeline: Timeline) -> dict:
    """Every metric of a run, JSON-serialisable with string keys and floats rounded to 6 places.
    A timeline whose meta has `price_per_hour` (the whole cluster's) also gets `cost_per_million_tokens`:
    that price x wall time per million trained tokens (prompts and responses, as `token_throughput`)."""
    check_conservation(timeline)
    wall = timeline.wall_s
    by_phase = device_seconds_by_phase(timeline)
    total = math.fsum(by_phase.values())
    idle = by_phase[Phase.IDLE]
    summary = {
        "policy": timeline.meta.get("policy"),
        "num_steps": len(timeline.steps),
        "wall_s": round(wall, 6),
        "token_throughput": round(_ratio(sum(s.tokens for s in timeline.steps), wall), 6),
        "generated_token_throughput": round(_ratio(sum(s.generated_tokens for s in timeline.steps), wall), 6),
        "rollout_tokens_per_gpu_s": round(_rollout_rate(timeline, by_phase[Phase.ROLLOUT]), 6),
        "trained_response_tokens_mean": round(
            _ratio(sum(s.generated_tokens for s in timeline.steps), sum(s.samples for s in timeline.steps)), 6
        ),
        "step_time_s": _step_time(timeline),
        "utilisation": {phase.value: round(_ratio(secs, total), 6) for phase, secs in by_phase.items()},
        "pool_utilisation": _pool_utilisation(timeline),
        "bubble_fraction": round(_ratio(idle, total), 6),
        "device_seconds": {"busy": round(total - idle, 6), "idle": round(idle, 6), "total": round(total, 6)},
        "staleness": _staleness(timeline),
        "sync_time_s": _sync_time(timeline),
        "counters": {name: round(float(value), 6) for name, value in sorted(timeline.counters.items())},
    }
    price = timeline.meta.get("price_per_hour")  # the cluster's, when the run was priced (sim: cluster.*price*)
    if price is not None:
        trained = sum(s.tokens for s in timeline.steps)
        summary["cost_per_million_tokens"] = round(_ratio(price * wall / 3600 * 1e6, trained), 6)
    return summary


IDLE_WARNING_SHARE = 0.5  # a pool idle for more than this share of its device time gets a warning


def pool_idle_shares(summary: dict) -> dict[str, float]:
    """Each pool's idle share of its device time, from a summary's `pool_utilisation` (busy shares)."""
    return {pool: round(1.0 - busy, 6) for pool, busy in summary["pool_utilisation"].items()}


def idle_warnings(summary: dict, unit: str = "GPUs") -> list[str]:
    """One line for each pool idle more than IDLE_WARNING_SHARE of the run, with what might put it to work.

    A train-capable pool beside a rollout pool waits for data: its share of the devices is too large for the
    batch. A rollout-only pool waits for training: too few train `unit`, or a staleness bound that holds it
    back. A single pool (every device does both) idles in the batch's long tail."""
    shares = pool_idle_shares(summary)
    lines = []
    for pool, idle in shares.items():
        if idle <= IDLE_WARNING_SHARE:
            continue
        if len(shares) == 1:
            hint = "a larger batch, or a policy that overlaps rollout and training?"
        elif "train" in pool.split("+"):
            hint = f"a larger batch or fewer train {unit}?"
        else:
            hint = f"more train {unit} or a looser staleness bound?"
        under = f"under {summary['policy']}, " if summary.get("policy") else ""
        name = pool.replace("+", " + ")
        lines.append(f"warning: {under}the {name} pool was idle {idle:.0%} of the time: {hint}")
    return lines
