"""Writing a run's outputs and printing readable tables."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from core.metrics import summarize
from core.outputs import provenance_header
from core.plot import draw_timeline, run_headline
from core.run_log import SEQUENCE_RATE
from core.timeline import Timeline
from core.trace import write_chrome_trace
from sim.config import SimConfig, config_dict


def write_run(
    timeline: Timeline, cfg: SimConfig, out: Path, picture: bool = True, provenance: dict | None = None
) -> dict:
    """summary.json, intervals.json (the timeline record, `Timeline.load` reads it back),
    timeline.json (Chrome trace), timeline.png and config.yaml in `out`. `provenance`
    (`core.outputs.provenance`) heads config.yaml as comments: the file stays a config `--config`
    accepts, and every other output depends on the config and the seed alone."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(timeline)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    timeline.save(out / "intervals.json")
    write_chrome_trace(timeline, out / "timeline.json")
    header = provenance_header(provenance) if provenance is not None else ""
    (out / "config.yaml").write_text(header + yaml.safe_dump(config_dict(cfg), sort_keys=False))
    if picture:
        draw_timeline(timeline, out / "timeline.png", run_title(summary, cfg))
    return summary


def run_title(summary: dict, cfg: SimConfig) -> str:
    """timeline.png's title: the run (policy, model, workload, cluster), then its throughput and idle shares."""
    return f"{summary['policy']}: {cfg.model}, {cfg.workload.kind}, {cfg.cluster_label}\n{run_headline(summary)}"


THROUGHPUT_LABEL = f"token throughput ({SEQUENCE_RATE})"  # summary.json's token_throughput
ROWS = [
    (THROUGHPUT_LABEL, lambda s: f"{s['token_throughput']:,.0f}"),
    ("step time mean / p50 / p99 (s)", lambda s: "{mean:.1f} / {p50:.1f} / {p99:.1f}".format(**s["step_time_s"])),
    ("wall time (s)", lambda s: f"{s['wall_s']:,.1f}"),
    ("bubble fraction", lambda s: f"{s['bubble_fraction']:.1%}"),
    (
        "device time % rollout/train/sync/switch",
        lambda s: "/".join(f"{100 * s['utilisation'][k]:.1f}" for k in ("rollout", "train", "sync", "switch")),
    ),
    ("rollout tokens per GPU-second", lambda s: f"{s['rollout_tokens_per_gpu_s']:,.0f}"),
    ("trained response length (mean tokens)", lambda s: f"{s['trained_response_tokens_mean']:,.0f}"),
    ("staleness (lag: share of tokens)", lambda s: _staleness(s)),
    ("weight sync (mean s, count)", lambda s: f"{s['sync_time_s']['mean']:.2f}, {s['sync_time_s']['count']}"),
    ("wasted tokens (restarted samples)", lambda s: f"{s['counters'].get('wasted_tokens', 0):,.0f}"),
]
# Shown when a run is priced (cluster.price_per_gpu_hour): in the user's currency.
COST_ROW = ("cost per million trained tokens", lambda s: f"{s['cost_per_million_tokens']:,.2f}")


def _staleness(s: dict) -> str:
    hist = s["staleness"]["histogram"]
    total = sum(hist.values()) or 1
    return " ".join(f"{lag}:{n / total:.0%}" for lag, n in hist.items())


def table(summaries: list[dict]) -> str:
    """One column per run."""
    names = [s["policy"] for s in summaries]
    rows = ROWS + ([COST_ROW] if all("cost_per_million_tokens" in s for s in summaries) else [])
    width = max(len(r[0]) for r in rows)
    cells = [[fmt(s) for s in summaries] for _, fmt in rows]
    col = max([len(n) for n in names] + [len(c) for row in cells for c in row])
    lines = [" " * width + "  " + "  ".join(n.rjust(col) for n in names)]
    for (label, _), row in zip(rows, cells, strict=True):
        lines.append(label.ljust(width) + "  " + "  ".join(c.rjust(col) for c in row))
    return "\n".join(lines)


def ratios(summaries: list[dict], baseline: str = "colocated") -> dict[str, dict[str, float]]:
    """Each policy's throughput and mean step time relative to `baseline`."""
    base = next(s for s in summaries if s["policy"] == baseline)
    out = {}
    for s in summaries:
        out[s["policy"]] = {
            "token_throughput": round(s["token_throughput"] / base["token_throughput"], 4),
            "step_time": round(s["step_time_s"]["mean"] / base["step_time_s"]["mean"], 4),
        }
    return out


def ratio_table(r: dict[str, dict[str, float]], baseline: str = "colocated") -> str:
    lines = [f"relative to {baseline}:  throughput  step time"]
    for name, v in r.items():
        lines.append(f"  {name:<14} {v['token_throughput']:>9.2f}x  {v['step_time']:>8.2f}x")
    return "\n".join(lines)
