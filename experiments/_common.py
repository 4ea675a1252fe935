"""Helpers shared by the experiment scripts: run one policy, derive the waste share, save outputs.

Everything here is a thin layer over library calls (`sim.config.load_config`, `sim.runner.simulate`,
`core.metrics.summarize`); no metric is computed here that the summary could not give.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from core.metrics import summarize
from sim.config import SimConfig, config_dict
from sim.runner import simulate

PAPER_RATIO = 2.0  # SeamlessFlow's headline: ~2x token throughput over a verl-style colocated baseline
NO_STAMP = {"Software": None}  # keep PNG bytes free of the matplotlib version


def run_policy(cfg: SimConfig, policy: str) -> dict:
    """Simulate `policy` on `cfg`; its summary."""
    return summarize(simulate(cfg, policy))


def trained_generated_tokens(summary: dict) -> float:
    """Response tokens that went into training steps."""
    return summary["generated_token_throughput"] * summary["wall_s"]


def wasted_share(summary: dict) -> float:
    """Share of all generated tokens thrown away by staleness restarts: wasted / (wasted + trained)."""
    wasted = summary["counters"].get("wasted_tokens", 0.0)
    total = wasted + trained_generated_tokens(summary)
    return wasted / total if total > 0 else 0.0


def save_config(cfg: SimConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False))


def save_json(data: object, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def source_fingerprint() -> str:
    """sha256 (12 hex digits) of the simulator's sources and specs, to tell which model made the numbers."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for pkg in ("core", "sim") for p in (root / pkg).rglob("*") if p.suffix in (".py", ".yaml")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
