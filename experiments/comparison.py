"""The runtime measured against the simulator's prediction, for `experiments.validate`: per policy and metric
(`METRICS`: trained tokens/s, step time, bubble, device-seconds a step in each phase), the measured mean over the
runtime's repeats with their range, the prediction, and the error (relative, or in percentage points for
shares); how well they agree over the policies (mean and largest errors, the policies' order on both sides,
the pairs the runtime's runs tell apart); printed as tables and drawn (`draw`).
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import numpy as np

from experiments._common import NO_STAMP

POLICIES = ("colocated", "disaggregated", "async", "tag", "streaming")
PHASES = ("rollout", "train", "sync", "idle")  # device time, per step, in both summaries' utilisation


def per_step_s(summary: dict, phase: str) -> float:
    """Device-seconds a step spends in `phase` (over every resource)."""
    total = summary["device_seconds"]["total"]
    return summary["utilisation"].get(phase, 0.0) * total / max(1, summary["num_steps"])


# Compared: (label, value of a summary, format, error kind: relative or percentage points).
METRICS = (
    ("trained tok/s", lambda s: s["token_throughput"], "{:,.0f}", "relative"),
    ("step (s)", lambda s: s["step_time_s"]["mean"], "{:.2f}", "relative"),
    ("bubble", lambda s: s["bubble_fraction"], "{:.1%}", "points"),
    *((f"{phase} dev-s/step", lambda s, p=phase: per_step_s(s, p), "{:.2f}", "relative") for phase in PHASES),
)


def runs_of(measured: dict | list) -> list[dict]:
    """A policy's measured summaries: a list of repeats, or one summary (an older validate.json)."""
    return list(measured) if isinstance(measured, list) else [measured]


def compare(measured: dict[str, dict | list[dict]], predicted: dict[str, dict | list[dict]]) -> dict[str, dict]:
    """Per policy and metric: the measured mean over the runtime's repeats with their range (`low`, `high`)
    and `spread` (half the range, relative to the mean; in points for shares), the prediction (the mean of
    the rounds' when each round was predicted from its own parts), and the error against the mean (relative
    for rates and times, in percentage points for shares), with each round's own error beside it
    (`round_errors`: its prediction against its run) when there is a prediction a round; ratios to colocated
    when it ran."""
    rows = {}
    for policy in measured:
        runs, guesses = runs_of(measured[policy]), runs_of(predicted[policy])
        row = {}
        for label, get, _, kind in METRICS:
            values = [get(r) for r in runs]
            guessed = [get(g) for g in guesses]
            m, p = statistics.fmean(values), statistics.fmean(guessed)
            half = (max(values) - min(values)) / 2
            spread = half if kind == "points" else (half / m if m else math.nan)
            row[label] = {
                "measured": m,
                "low": min(values),
                "high": max(values),
                "spread": spread,
                "runs": len(runs),
                "predicted": p,
                "error": _error(p, m, kind),
                "error_kind": kind,
            }
            if len(guesses) == len(runs) > 1:
                row[label]["round_predicted"] = guessed
                row[label]["round_errors"] = [_error(g, v, kind) for g, v in zip(guessed, values, strict=True)]
                row[label]["round_measured"] = values
        rows[policy] = row
    if "colocated" in measured:
        base = rows["colocated"]["trained tok/s"]
        for row in rows.values():
            row["ratio to colocated"] = {
                "measured": row["trained tok/s"]["measured"] / base["measured"],
                "predicted": row["trained tok/s"]["predicted"] / base["predicted"],
            }
    return rows


def _error(predicted: float, measured: float, kind: str) -> float:
    if kind == "points":
        return predicted - measured
    return predicted / measured - 1 if measured else math.nan


def agreement(rows: dict[str, dict]) -> dict:
    """How well the prediction agrees over the policies: the mean and the largest absolute error of
    throughput and of step time, the runtime's own largest spread beside them, and the policies ordered by
    throughput on each side; with a prediction a round, the same for each round alone (`rounds`: its mean
    and largest errors, and whether its order is its run's)."""
    out: dict = {}
    for label in ("trained tok/s", "step (s)"):
        errors = [abs(row[label]["error"]) for row in rows.values()]
        out[label] = {
            "mean_abs_error": statistics.fmean(errors),
            "max_abs_error": max(errors),
            "largest_spread": max(row[label]["spread"] for row in rows.values()),
        }
    for side in ("measured", "predicted"):
        out[f"order_{side}"] = sorted(rows, key=lambda p: -rows[p]["trained tok/s"][side])
    out["same_order"] = out["order_measured"] == out["order_predicted"]
    out["separated_pairs"] = separated_pairs(rows)
    if all("round_errors" in row["trained tok/s"] for row in rows.values()):
        count = len(next(iter(rows.values()))["trained tok/s"]["round_errors"])
        out["rounds"] = []
        for i in range(count):
            entry = {}
            for label in ("trained tok/s", "step (s)"):
                errors = [abs(row[label]["round_errors"][i]) for row in rows.values()]
                entry[label] = {"mean_abs_error": statistics.fmean(errors), "max_abs_error": max(errors)}
            for side in ("measured", "predicted"):
                entry[f"order_{side}"] = sorted(rows, key=lambda p, k=f"round_{side}": -rows[p]["trained tok/s"][k][i])
            entry["same_order"] = entry["order_measured"] == entry["order_predicted"]
            out["rounds"].append(entry)
    return out


def separated_pairs(rows: dict[str, dict]) -> list[dict]:
    """The pairs of policies the runtime's own runs tell apart by throughput: the faster one's slowest run above
    the slower one's fastest (with one run each, every pair); each with whether the simulator puts them in the
    same order (`same`). Pairs whose runs overlap have no measured order to agree with."""
    pairs = []
    for a, b in itertools.combinations(rows, 2):
        x, y = rows[a]["trained tok/s"], rows[b]["trained tok/s"]
        faster, slower = (a, b) if x["measured"] >= y["measured"] else (b, a)
        f, s = rows[faster]["trained tok/s"], rows[slower]["trained tok/s"]
        if f.get("low", f["measured"]) > s.get("high", s["measured"]):
            pairs.append({"faster": faster, "slower": slower, "same": f["predicted"] > s["predicted"]})
    return pairs


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'policy':<14} {'metric':<19} {'measured':>10} {'range (runs)':>24} {'simulated':>10} {'error':>8}"]
    formats = {label: fmt for label, _, fmt, _ in METRICS}
    for policy, row in sorted(rows.items(), key=lambda item: POLICIES.index(item[0])):
        for label, cell in row.items():
            fmt = formats.get(label, "{:.2f}x")
            err = cell.get("error")
            shown = "" if err is None else (f"{100 * err:+.1f} pt" if cell["error_kind"] == "points" else f"{err:+.0%}")
            spread = ""
            if "low" in cell:
                spread = f"{fmt.format(cell['low'])}-{fmt.format(cell['high'])} ({cell['runs']})"
            lines.append(
                f"{policy:<14} {label:<19} {fmt.format(cell['measured']):>10} {spread:>24} "
                f"{fmt.format(cell['predicted']):>10} {shown:>8}"
            )
            policy = ""
    return "\n".join(lines)


def agreement_text(agree: dict) -> str:
    lines = []
    for label in ("trained tok/s", "step (s)"):
        a = agree[label]
        lines.append(
            f"{label}: mean |error| {a['mean_abs_error']:.0%}, largest {a['max_abs_error']:.0%} "
            f"(the runtime's own spread: up to +-{a['largest_spread']:.0%})"
        )
    same = "the same" if agree["same_order"] else "a different"
    lines.append(f"by throughput, measured: {' > '.join(agree['order_measured'])}")
    lines.append(f"by throughput, simulated: {' > '.join(agree['order_predicted'])} ({same} order)")
    if "separated_pairs" in agree:  # (validate.json files written before it have none)
        pairs, n = agree["separated_pairs"], len(agree["order_measured"])
        wrong = [f"{p['faster']} > {p['slower']}" for p in pairs if not p["same"]]
        lines.append(
            f"pairs the runtime's runs tell apart (one's slowest run above the other's fastest): {len(pairs)} "
            f"of {n * (n - 1) // 2}; the simulator orders {len(pairs) - len(wrong)} of them the same"
            + (f" (not: {', '.join(wrong)})" if wrong else "")
        )
    for i, entry in enumerate(agree.get("rounds", [])):
        cells = [
            f"{label} mean |error| {entry[label]['mean_abs_error']:.0%}, largest {entry[label]['max_abs_error']:.0%}"
            for label in ("trained tok/s", "step (s)")
        ]
        same = "the same order" if entry["same_order"] else f"order {' > '.join(entry['order_predicted'])}"
        lines.append(f"round {i + 1} (its own parts and runs): " + "; ".join(cells) + f"; {same}")
    return "\n".join(lines)


def draw(rows: dict[str, dict], path: Path, note: str) -> None:
    """Measured against simulated, per policy: trained tokens/s, and how each policy spends device time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in POLICIES if p in rows]
    x = np.arange(len(policies))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    for k, (side, colour) in enumerate((("measured", "#4c72b0"), ("predicted", "#dd8452"))):
        values = [rows[p]["trained tok/s"][side] for p in policies]
        cells = [rows[p]["trained tok/s"] for p in policies]
        span, name = None, "simulator (predicted)"
        if side == "measured" and all("low" in c for c in cells):  # the runtime's repeats: their range
            span = [[c["measured"] - c["low"] for c in cells], [c["high"] - c["measured"] for c in cells]]
        if side == "predicted" and all("round_predicted" in c for c in cells):  # a prediction a round: their range
            span = [
                [c["predicted"] - min(c["round_predicted"]) for c in cells],
                [max(c["round_predicted"]) - c["predicted"] for c in cells],
            ]
            name = "simulator (range: each round's own parts)"
        if side == "measured":
            name = "runtime (measured, range of runs)"
        bars = ax1.bar(x + (k - 0.5) * 0.38, values, 0.38, color=colour, yerr=span, capsize=3, label=name)
        ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, padding=2)
    top = max(
        max(c.get("high", 0), c["measured"], c["predicted"], *c.get("round_predicted", ()))
        for c in (rows[p]["trained tok/s"] for p in policies)
    )
    ax1.set_ylim(0, 1.4 * top)  # room for the legend above the bars
    ax1.set_xticks(x, policies)
    ax1.set_ylabel("trained tokens / s")
    ax1.set_title("Throughput")
    ax1.legend(loc="upper left", fontsize=8)
    colours = {"rollout": "#55a868", "train": "#4c72b0", "sync": "#c44e52", "idle": "#cccccc"}
    for k, side in enumerate(("measured", "predicted")):
        bottom = np.zeros(len(policies))
        for phase, colour in colours.items():
            values = np.array([rows[p][f"{phase} dev-s/step"][side] for p in policies])
            ax2.bar(
                x + (k - 0.5) * 0.38,
                values,
                0.36,
                bottom=bottom,
                color=colour,
                hatch="" if k == 0 else "//",
                edgecolor="white",
                label=phase if k == 0 else None,
            )
            bottom += values
    ax2.set_ylim(0, 1.2 * ax2.get_ylim()[1])
    ax2.set_xticks(x, policies)
    ax2.set_ylabel("device-seconds per step (all resources)")
    ax2.set_title("Where a step's device time goes: runtime left, simulator right (hatched)", fontsize=10)
    ax2.legend(loc="upper right", fontsize=7, ncols=4)
    fig.suptitle(f"Simulator against runtime, costs measured part by part ({note})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130, metadata=NO_STAMP)
    plt.close(fig)
