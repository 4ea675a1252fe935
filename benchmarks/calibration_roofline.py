"""The simulator's side of benchmarks/gpu_calibration.py: sim/cost.py's roofline predictions for what was
measured, and the tables that print each measurement beside its prediction (and the measured peaks beside the
device spec's figures). The predictions are made in the setup the measurements run in (`PREDICTION`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.specs import DeviceSpec, ModelSpec
from reference.measure import Peaks
from sim import train_layout
from sim.config import load_config
from sim.cost import CostModel
from sim.profile import MEASURED_SETUP, ModelProfile

if TYPE_CHECKING:
    from benchmarks.gpu_calibration import Plan

# The simulator's config for the predictions: one GPU an engine, and the trainer measured here (the setup
# sim/calibration.py fits a profile's points in).
PREDICTION = MEASURED_SETUP


class Roofline:
    """sim/cost.py's predictions for one model on one device, in the measured setup (`PREDICTION`)."""

    def __init__(self, model: ModelSpec, device: DeviceSpec) -> None:
        self.model, self.device = model, device
        self.cfg = load_config(overrides=list(PREDICTION))
        self.cost = CostModel(self.cfg, model, device)

    def decode_s(self, batch: int, context: int) -> float:
        return self.cost.decode_step_s(batch, batch * context)

    def prefill_s(self, tokens: int) -> float:
        return self.cost.prefill_s(tokens, tokens * tokens / 2)

    def train_s(self, seq_len: int) -> float:
        return train_layout.step(self.cfg, self.model, self.device, [seq_len], 1).total_s

    def mfu(self, seq_len: int, seconds: float) -> float:
        return self.mfu_of(self.model, self.device, seq_len, seconds)

    def logprob_s(self, seq_len: int) -> float:
        c = self.cfg.costs
        return train_layout.forward_s(
            self.model, self.device, seq_len, c.logprob_mfu, c.logprob_attention_mfu, c.logprob_layer_host_s
        )

    @staticmethod
    def mfu_of(model: ModelSpec, device: DeviceSpec, seq_len: int, seconds: float) -> float:
        """Model FLOPs utilisation of a training step over `seq_len` tokens that takes `seconds`."""
        return 3 * train_layout.forward_flops(model, [seq_len]) / seconds / (device.peak_tflops * 1e12)


def _cells(measured_s: float, sim_s: float | None) -> str:
    """Measured ms, predicted ms and predicted / measured."""
    if sim_s is None:
        return f"{measured_s * 1e3:12.3f} {'-':>10} {'-':>13}"
    return f"{measured_s * 1e3:12.3f} {sim_s * 1e3:10.3f} {sim_s / measured_s:13.3g}"


def _pct(value: float | None) -> str:
    return f"{value:8.1%}" if value is not None else f"{'-':>8}"


def table(entry: ModelProfile, spec: ModelSpec, plan: Plan) -> list[str]:
    """The measurements of one model, each beside the roofline's prediction."""
    roof = Roofline(spec, plan.spec) if plan.spec else None
    where = f"{plan.device_name} ({plan.device}), {str(plan.dtype).removeprefix('torch.')}"
    sim = f"the {plan.spec.name} roofline (sim/cost.py)" if plan.spec else "none (no device spec: --device-spec)"
    head = f"{'measured ms':>12} {'sim ms':>10} {'sim/measured':>13}"
    size = f"{spec.params / 1e9:.2f} B" if spec.params >= 1e8 else f"{spec.params / 1e6:.2f} M"
    lines = [f"{spec.name}: {size} parameters on {where}; sim: {sim}"]
    if "decode" in plan.parts:
        lines.append(f"  {'decode':<8} {'batch':>7} {'context':>8} {head}")
    for p in entry.decode:
        sim_s = roof.decode_s(p.batch, p.context) if roof else None
        lines.append(f"  {'':<8} {p.batch:7d} {p.context:8d} {_cells(p.step_s, sim_s)}")
    if "prefill" in plan.parts:
        lines.append(f"  {'prefill':<8} {'tokens':>7} {'':>8} {head}")
    for p in entry.prefill:
        sim_s = roof.prefill_s(p.tokens) if roof else None
        lines.append(f"  {'':<8} {p.tokens:7d} {'':>8} {_cells(p.seconds, sim_s)}")
    if "train" in plan.parts:
        lines.append(f"  {'train':<8} {'seq_len':>7} {'tokens/s':>8} {head} {'MFU':>8} {'sim MFU':>8}")
    for p in entry.train:
        sim_s = roof.train_s(p.seq_len) if roof else None
        sim_mfu = roof.mfu(p.seq_len, sim_s) if roof else None
        cells = _cells(p.seq_len / p.tokens_per_s, sim_s)
        lines.append(f"  {'':<8} {p.seq_len:7d} {p.tokens_per_s:8.0f} {cells} {_pct(p.mfu)} {_pct(sim_mfu)}")
    if "logprob" in plan.parts:
        lines.append(f"  {'logprob':<8} {'seq_len':>7} {'tokens/s':>8} {head} {'MFU':>8} {'sim MFU':>8}")
    for p in entry.logprob:
        sim_s = roof.logprob_s(p.seq_len) if roof else None
        sim_mfu = roof.cfg.costs.logprob_mfu if roof else None
        cells = _cells(p.seq_len / p.tokens_per_s, sim_s)
        lines.append(f"  {'':<8} {p.seq_len:7d} {p.tokens_per_s:8.0f} {cells} {_pct(p.mfu)} {_pct(sim_mfu)}")
    lines += [f"  skipped: {reason}" for reason in entry.skipped]
    return lines


def peak_lines(peaks: Peaks, plan: Plan) -> list[str]:
    """The measured ceilings, each beside the device spec's figure."""
    spec = plan.spec
    rows = [
        ("matrix product", f"{plan.peak_sizes[0]}^3", peaks.matmul_tflops, "TFLOP/s", spec and spec.peak_tflops),
        ("device copy", f"{plan.peak_sizes[1] >> 20} MiB", peaks.copy_gb_s, "GB/s", spec and spec.hbm_bandwidth_gb_s),
        ("host to device", "pinned", peaks.host_to_device_gb_s, "GB/s", spec and spec.pcie_gb_s),
        ("device to host", "pinned", peaks.device_to_host_gb_s, "GB/s", spec and spec.pcie_gb_s),
    ]
    lines = [f"peaks on {plan.device_name}: measured, and the share of the {spec.name if spec else '-'} spec"]
    for what, size, value, unit, datasheet in rows:
        if value is None:
            continue
        share = f"{value / datasheet:8.1%}" if datasheet else f"{'-':>8}"
        lines.append(f"  {what:<15} {size:>10} {value:10.1f} {unit:<8} {share}")
    return lines
