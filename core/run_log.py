"""A run's per-step metrics for people and dashboards, shared by `python -m reference train` and `python -m sim`.

- `step_line`: the one line a step printed where stderr is not a terminal (nohup, a batch scheduler, a pipe):
  `step 12/500  reward 0.410  1,830 gen tok/s  staleness 0.60  43 s`. "gen tok/s" counts generated tokens only
  (those in the loss), unlike the summary's token throughput, which counts every token of the trained sequences
  (prompts too): `GEN_RATE` and `SEQUENCE_RATE` name the two wherever they are shown.
- `ScalarLog`: the same figures, and every other number of a step's record, as TensorBoard event files
  (`--tensorboard DIR`, written with tensorboardX: the `tensorboard` extra) and/or a Weights & Biases run
  (`--wandb PROJECT`, with `wandb` installed). Both are off unless asked for; a missing package is one
  `UserError` line naming the pip command, raised by `require` before anything starts.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import UserError

TENSORBOARD_PIP = "pip install tensorboardX (or pip install -e '.[tensorboard]')"
WANDB_PIP = "pip install wandb"
TAG_PREFIX = "train/"  # TensorBoard groups the scalars in a section of this name
EVAL_PREFIX = "eval/"  # and the held-out evaluations' in this one
GEN_RATE = "gen tok/s"  # generated tokens trained (those in the loss) per wall second
SEQUENCE_RATE = "trained-sequence tok/s"  # every token of the trained sequences, prompt and response, per wall second


def require(tensorboard: str | Path | None = None, wandb: str | None = None) -> None:
    """UserError (one line) if a logger was asked for and its package is not installed."""
    if tensorboard is not None and importlib.util.find_spec("tensorboardX") is None:
        raise UserError(f"--tensorboard needs the tensorboardX package: {TENSORBOARD_PIP}")
    if wandb is not None:
        if not str(wandb).strip():
            raise UserError("--wandb needs a project name")
        if importlib.util.find_spec("wandb") is None:
            raise UserError(f"--wandb needs the wandb package: {WANDB_PIP}")


def mean_lag(lag_tokens: Mapping) -> float:
    """The token-weighted mean staleness of a step (its trained tokens by the policy version lag they had)."""
    total = sum(lag_tokens.values())
    return sum(int(lag) * n for lag, n in lag_tokens.items()) / total if total else 0.0


def step_line(
    done: int, total: int, reward: float | None, tokens_per_s: float, staleness: float, elapsed_s: float
) -> str:
    """One step in one line; `reward` None (a simulated run) leaves it out. `tokens_per_s`: generated tokens
    trained so far per second of the run (GEN_RATE)."""
    shown = "" if reward is None or not math.isfinite(reward) else f"  reward {reward:.3f}"
    rate = f"{tokens_per_s:,.0f} {GEN_RATE}"
    return f"step {done}/{total}{shown}  {rate}  staleness {staleness:.2f}  {elapsed_s:,.0f} s"


def scalars(record: Mapping[str, Any], skip: tuple[str, ...] = ("step",)) -> dict[str, float]:
    """The finite numbers of a step's record, nested mappings flattened with '/' (`episodes/tool_s_sum`)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in skip:
            continue
        if isinstance(value, Mapping):
            if key == "staleness":  # lag -> tokens: a histogram, not figures of its own
                continue
            out.update({f"{key}/{k}": v for k, v in scalars(value, ()).items()})
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class ScalarLog:
    """Per-step scalars to TensorBoard event files in `tensorboard` and/or a W&B run of project `wandb`; a
    ScalarLog with neither does nothing. `run_name` names the W&B run; `config` is stored with it."""

    def __init__(
        self,
        tensorboard: str | Path | None = None,
        wandb: str | None = None,
        run_name: str | None = None,
        config: Mapping | None = None,
        wandb_dir: str | Path | None = None,
    ) -> None:
        require(tensorboard, wandb)
        self.tensorboard = Path(tensorboard) if tensorboard is not None else None
        self._tb = self._wandb = None
        if self.tensorboard is not None:
            from tensorboardX import SummaryWriter

            self.tensorboard.mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(logdir=str(self.tensorboard), flush_secs=10)
        if wandb is not None:
            import wandb as wandb_module

            kwargs = {"project": wandb, "name": run_name, "config": dict(config or {})}
            if wandb_dir is not None:
                kwargs["dir"] = str(wandb_dir)
            self._wandb = wandb_module.init(**kwargs)

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def log(self, step: int, values: Mapping[str, float], prefix: str = TAG_PREFIX) -> None:
        """`values` at `step`, each named `prefix` + its key (TensorBoard's section, then the figure)."""
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(prefix + key, value, step)
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in values.items()}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> ScalarLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_scalars(folder: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under `folder`: tag -> [(step, value)] in file order. Reads
    the TFRecord framing (length, its CRC, the event, its CRC) and tensorboardX's Event protobuf."""
    import struct

    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(folder).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found
