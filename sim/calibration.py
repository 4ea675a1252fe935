"""Calibrated costs: the roofline's constants fitted to what one device measured.

A profile (sim/profile.py; benchmarks/gpu_calibration.py writes one) holds decode step times, prefill
times, training and log-prob throughput of models on one device. `costs.profile` names one; `calibrate`
fits the constants of sim/cost.py's roofline to the points of every model the profile measured on that
device at once, by least squares on relative error, in the setup the points were measured in
(`profile.MEASURED_SETUP`: one GPU), and the cost model then runs on the fitted values. One set of
constants per device: what differs between models (layers, parameters, KV bytes, attention width) is in
the roofline's terms, so the constants carry over to a model the profile did not measure. With L the
model's layers:

- decode: step = max(W / hbm + KV / kv_hbm, C / decode_mfu) + L x (o + b x s) + L x ctx x w at batch b and
  context ctx: weights W and KV cache KV read, matmul and attention FLOPs C; o and s
  (`decode_layer_overhead_s`, `decode_seq_layer_overhead_s`) are a step's small kernels per layer, and per
  layer and sequence; w (`decode_ctx_latency_s`) the attention's walk over one sequence's cache per layer
  and context token, which a kernel that does not split the cache over the multiprocessors pays at any
  batch. Where the profile measured the device's copy bandwidth, W is read at that share of the
  datasheet's (`hbm_efficiency`, measured: a fit cannot tell the weights' rate from o), and the KV cache
  at `kv_hbm_efficiency`, fitted; otherwise both at one fitted `hbm_efficiency`;
- prefill: seconds = overlap(max(M / prefill_mfu + A / prefill_attention_mfu, W / hbm), L x h) with matmul
  FLOPs M, attention FLOPs A, and h (`prefill_layer_host_s`) the host's time to launch one layer of an
  eager forward; `train_layout.overlap` is the 2-norm of device and host time;
- training: overlap(M / train_mfu + A / train_attention_mfu, L x h_train) + optimizer, the trainer's step
  on one GPU (sim/train_layout.py; the points are measured without recompute, so model FLOPs run at 4/3 of
  the efficiencies, the convention of HFU_PER_MFU);
- log-probs: overlap(M / logprob_mfu + A / logprob_attention_mfu, L x h_logprob), the trainer's
  forward-only pass over one sequence.

What the per-layer terms are, on the shipped H200 profile (plain torch, docs/speed.md "GPU calibration"): o, a
CUDA graph's tens of small kernels a layer (norms, rotary, cache writes) at a few microseconds each; w,
sdpa over a padded cache, one thread block per sequence and KV head, so one sequence's cache is read at
a small share of the bandwidth; h, Python and kernel launches of eager passes (prefill and log-probs
about 0.7-1 ms a layer, training about 4 ms), which bound the small models and short sequences.

Why fit constants rather than interpolate the points: a run asks for batches, contexts, models and
layouts that no profile measured (engines of 4 GPUs at 200 sequences of 3,000 tokens, ZeRO-3 over 32
GPUs); the roofline with fitted constants extrapolates along bytes, FLOPs and layers, where an
interpolation of a one-GPU grid has nothing to say outside it. What the roofline cannot express remains
as fit error, reported per part and model (`rms_error`, `rms_error_by_model`).

A constant the points do not pin down (its relative standard error above MAX_RELATIVE_SE in
sim/least_squares.py, or a part with fewer points than constants) keeps the config's value, with the
reason (`kept`): e.g. decode_mfu when every decode point is memory-bound (only a lower bound is known,
and the kept value is raised to it so the fit still holds), a host time when every point is
device-bound. The per-step overheads
(decode_step_overhead_s, decode_seq_overhead_s, prefill_overhead_s) are set to 0 where the per-layer
ones are fitted: they describe the same time. The overheads of training and the communication
efficiencies are never calibrated: a profile measures one GPU. A rollout pool of another device keeps
the config's constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from core import config as cfgio
from core import specs
from core.specs import DeviceSpec, ModelSpec
from sim import profile as profiles
from sim import train_layout
from sim.config import CostConfig, SimConfig, config_dict
from sim.cost import CostModel
from sim.least_squares import Param, Part, fit_part

TRAIN_MFU_CAP = 1 / train_layout.HFU_PER_MFU  # train_mfu counts model FLOPs of recomputing runs
PER_STEP = ("decode_step_overhead_s", "decode_seq_overhead_s")  # replaced by the per-layer overheads
# The constants of each part, in the order a fit drops those it cannot pin down (last first).
DECODE = ("decode_mfu", "decode_layer_overhead_s", "decode_seq_layer_overhead_s", "decode_ctx_latency_s")
PREFILL = ("prefill_mfu", "prefill_attention_mfu", "prefill_layer_host_s")
TRAIN = ("train_mfu", "train_layer_host_s", "train_attention_mfu")
LOGPROB = ("logprob_mfu", "logprob_attention_mfu", "logprob_layer_host_s")
PARTS = ("decode", "prefill", "train", "logprob")
FITTED_KEYS = (
    "hbm_efficiency",
    "kv_hbm_efficiency",
    *DECODE,
    *PER_STEP,
    *PREFILL,
    "prefill_overhead_s",
    *TRAIN,
    *LOGPROB,
)


@dataclass(frozen=True)
class Calibration:
    """The constants a profile set for one device, and how well the roofline fits its points."""

    profile: str  # costs.profile as given
    device: str  # the device the profile names
    model: str | None  # the profile's entry for the run's model; None: not measured (the device's constants)
    constants: dict[str, float | None]  # costs.<key> -> the value the cost model uses
    fitted: tuple[str, ...]  # keys of `constants` fitted to points; the others are `kept` or `measured`
    kept: dict[str, str]  # costs.<key> -> why the profile did not set it
    rms_error: dict[str, float]  # part -> root-mean-square relative error at the run's model's points
    points: dict[str, int]  # part -> points measured of the run's model
    measured: dict[str, str] = dataclasses.field(default_factory=dict)  # costs.<key> -> the measurement
    models: tuple[str, ...] = ()  # the profile's models the constants were fitted to
    rms_error_by_model: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def costs(self, base: CostConfig) -> CostConfig:
        """`base` with the constants this calibration set: what the cost model runs on."""
        return dataclasses.replace(base, **self.constants)

    def to_dict(self) -> dict:
        """For a run's provenance: fitted values, kept ones with their reason, fit errors."""
        return {
            "profile": self.profile,
            "device": self.device,
            "model": self.model,
            "fitted_to": list(self.models),
            "fitted": {k: _short(self.constants[k]) for k in self.fitted},
            "measured": {k: {"value": _short(self.constants[k]), "from": m} for k, m in self.measured.items()},
            "kept": {k: {"value": _short(self.constants[k]), "why": why} for k, why in self.kept.items()},
            "rms_relative_error": self.rms_error,
            "rms_relative_error_by_model": self.rms_error_by_model,
            "points": self.points,
        }


def _short(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")


def calibrated_cost_model(cfg: SimConfig, model: ModelSpec, device: DeviceSpec) -> tuple[CostModel, Calibration | None]:
    """The calibration of `device` first (`calibrate`; None without one), then the cost model on the constants it
    set, `cfg.costs`' where it set none: how a run prices the work of one device."""
    calibration = calibrate(cfg, model, device)
    costs = cfg.costs if calibration is None else calibration.costs(cfg.costs)
    return CostModel(cfg, model, device, costs), calibration


def calibrate(cfg: SimConfig, model: ModelSpec, device: DeviceSpec) -> Calibration | None:
    """The constants `cfg.costs.profile` sets on `device` for `model`; None when there is no profile or the
    profile is of another device (a rollout pool's). SimConfig has checked the device."""
    name = cfg.costs.profile
    if name is None:
        return None
    profile = profiles.read_profile(name)
    if (profile.device.spec or "").lower() != device.name.lower():
        return None
    return _calibrate(cfg, model, device, profile)


@lru_cache(maxsize=16)
def _calibrate(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, profile: profiles.Profile) -> Calibration:
    entry = profiles.entry_for(profile, model, cfg.model)
    fit = _device_fit(_fit_key(cfg), device, profile, (entry.model, model) if entry else None)
    calibrated = measured_setup(cfg, **fit.values)
    by_model = {
        name: _errors(CostModel(calibrated, spec, device, calibrated.costs), calibrated, e)
        for name, spec, e in fit.entries
    }
    own = by_model.get(entry.model, {}) if entry else {}
    return Calibration(
        profile=cfg.costs.profile,
        device=profile.device.spec or profile.device.name,
        model=entry.model if entry else None,
        constants=fit.values,
        fitted=fit.fitted,
        kept=fit.kept,
        measured=fit.measured,
        rms_error=own,
        points={part: len(getattr(entry, part)) for part in PARTS} if entry else dict.fromkeys(PARTS, 0),
        models=tuple(name for name, _, _ in fit.entries),
        rms_error_by_model=by_model,
    )


def _fit_key(cfg: SimConfig) -> SimConfig:
    """`cfg` in the setup the profile was measured in: what the fit reads, and the key of its cache."""
    return measured_setup(cfg)


def measured_setup(cfg: SimConfig, **costs: float | None) -> SimConfig:
    """`cfg` in the setup a profile was measured in (one GPU, ...), with these costs.* values."""
    data = cfgio.apply_overrides(config_dict(cfg), list(profiles.MEASURED_SETUP))
    data["costs"].update(costs)
    return cfgio.from_dict(SimConfig, data)


# ---- the joint fit ----


@dataclass(frozen=True)
class _DeviceFit:
    values: dict[str, float | None]
    fitted: tuple[str, ...]
    kept: dict[str, str]
    measured: dict[str, str]
    entries: tuple[tuple[str, ModelSpec, profiles.ModelProfile], ...]  # the models fitted to


@lru_cache(maxsize=16)
def _device_fit(cfg: SimConfig, device: DeviceSpec, profile: profiles.Profile, run_model) -> _DeviceFit:
    """The constants of every part, fitted to the points of all the profile's models whose architecture is
    known (a shipped model, or the run's own) at once."""
    entries = []
    for e in profile.models:
        spec = run_model[1] if run_model and e.model == run_model[0] else specs.models().get(e.model.lower())
        if spec is not None:
            entries.append((e.model, spec, e))
    c = cfg.costs
    values: dict[str, float | None] = {k: getattr(c, k) for k in FITTED_KEYS}
    kept: dict[str, str] = {}
    fitted: list[str] = []
    measured: dict[str, str] = {}
    copy = profile.device.copy_gb_s
    weights_at = None if copy is None else min(1.0, copy / device.hbm_bandwidth_gb_s)
    if weights_at is not None:
        values["hbm_efficiency"] = weights_at
        measured["hbm_efficiency"] = f"the device's copy: {copy:.6g} GB/s of the spec's {device.hbm_bandwidth_gb_s:g}"
    unit = _unit_setup(cfg)
    units = {name: CostModel(unit, spec, device, unit.costs) for name, spec, _ in entries}
    for part, fit_points in (
        ("decode", _fit_decode),
        ("prefill", _fit_prefill),
        ("train", _fit_train),
        ("logprob", _fit_logprob),
    ):
        points = [(units[name], spec, p) for name, spec, e in entries for p in getattr(e, part)]
        result = fit_points(cfg, device, points, values, weights_at)
        values.update(result.values)
        fitted += result.fitted
        kept |= result.kept
    return _DeviceFit(values, tuple(fitted), kept, measured, tuple(entries))


def _unit_setup(cfg: SimConfig) -> SimConfig:
    """Every efficiency 1, no overhead: a cost model of the bare roofline terms."""
    ones = dict.fromkeys(("hbm_efficiency", "decode_mfu", "prefill_mfu"), 1.0)
    zeros = dict.fromkeys((*PER_STEP, *DECODE[1:], "prefill_layer_host_s"), 0.0)
    return measured_setup(cfg, **ones, **zeros, kv_hbm_efficiency=None, prefill_attention_mfu=None)


def _slowest(t: np.ndarray, layers: np.ndarray) -> float:
    """An upper bound for seconds a layer: every point's time in one layer."""
    return float((t / layers).max()) * 4


def _fit_decode(cfg, device, points, values, weights_at) -> Part:
    if not points:
        return Part({}, (), dict.fromkeys(("decode_mfu", *DECODE[1:]), "no decode points"))
    c = cfg.costs
    weights, kv, compute, layers, batch, ctx, t = (
        np.array(v, dtype=float)
        for v in zip(
            *(
                (
                    unit.decode_weights_s(p.batch),
                    unit.terms.decode.kv_s_per_token * (p.batch * p.context),
                    unit.decode_lines(p.batch, p.batch * p.context).p2,
                    spec.layers,
                    p.batch,
                    p.context,
                    p.step_s,
                )
                for unit, spec, p in points
            ),
            strict=True,
        )
    )
    kv_key = "kv_hbm_efficiency" if weights_at is not None else "hbm_efficiency"
    kv_default = (c.kv_hbm_efficiency or c.hbm_efficiency) if weights_at is not None else c.hbm_efficiency

    def predict(v: dict[str, float]) -> np.ndarray:
        read = weights / (weights_at or v[kv_key]) + kv / v[kv_key]
        per_layer = v["decode_layer_overhead_s"] + batch * v["decode_seq_layer_overhead_s"]
        return np.maximum(read, compute / v["decode_mfu"]) + layers * (per_layer + ctx * v["decode_ctx_latency_s"])

    top = _slowest(t, layers)
    params = [
        Param(kv_key, kv_default, 1.0),
        Param("decode_mfu", c.decode_mfu, 1.0),
        Param("decode_layer_overhead_s", c.decode_layer_overhead_s, top),
        Param("decode_seq_layer_overhead_s", c.decode_seq_layer_overhead_s, top / float(batch.max())),
        Param("decode_ctx_latency_s", c.decode_ctx_latency_s, top / float(ctx.max())),
    ]
    part = fit_part(predict, t, params, "decode")
    result = {**{p.name: p.default for p in params}, **part.values, **dict.fromkeys(PER_STEP, 0.0)}
    kept = dict(part.kept)
    if "decode_mfu" in kept:  # only a lower bound is known: raise the config's value to it
        floor = float(np.max(compute / (weights / (weights_at or result[kv_key]) + kv / result[kv_key])))
        result["decode_mfu"] = min(1.0, max(c.decode_mfu, floor))
        kept["decode_mfu"] += f"; the points bind it only from below (>= {floor:.3g})"
    if "decode_layer_overhead_s" in part.fitted:
        for key in PER_STEP:  # the same time, per layer
            kept[key] = "0: the per-layer overheads fitted across models describe the same time"
    else:
        result.update({key: getattr(c, key) for key in PER_STEP})
        kept |= dict.fromkeys(PER_STEP, "the config's: the per-layer overheads were not fitted")
    return Part(result, part.fitted, kept)


def _eager_pass_params(part: str, c, t: np.ndarray, layers: np.ndarray) -> list[Param]:
    """An eager forward's constants (`<part>_mfu`, `<part>_attention_mfu`, `<part>_layer_host_s`), their
    defaults the config's (attention at the matmuls' efficiency when null)."""
    mfu = getattr(c, f"{part}_mfu")
    return [
        Param(f"{part}_mfu", mfu, 1.0),
        Param(f"{part}_attention_mfu", getattr(c, f"{part}_attention_mfu") or mfu, 1.0),
        Param(f"{part}_layer_host_s", getattr(c, f"{part}_layer_host_s"), _slowest(t, layers)),
    ]


def _fit_prefill(cfg, device, points, values, weights_at) -> Part:
    c = cfg.costs
    if not points:
        return Part({}, (), dict.fromkeys((*PREFILL, "prefill_overhead_s"), "no prefill points"))
    flops = [unit.prefill_flops(p.tokens, p.tokens * p.tokens / 2) for unit, _, p in points]
    rows = [
        (f.matmul, f.attention, unit.weight_bytes_read(p.tokens), spec.layers, p.seconds)
        for f, (unit, spec, p) in zip(flops, points, strict=True)
    ]
    matmul, attention, weights, layers, t = (np.array(v, dtype=float) for v in zip(*rows, strict=True))
    peak = device.peak_tflops * 1e12
    memory = weights / (device.hbm_bandwidth_gb_s * 1e9 * values["hbm_efficiency"])

    def predict(v: dict[str, float]) -> np.ndarray:
        compute = matmul / (peak * v["prefill_mfu"]) + attention / (peak * v["prefill_attention_mfu"])
        return np.hypot(np.maximum(compute, memory), layers * v["prefill_layer_host_s"])

    params = _eager_pass_params("prefill", c, t, layers)
    part = fit_part(predict, t, params, "prefill")
    result = {**{p.name: p.default for p in params}, **part.values}
    if "prefill_attention_mfu" not in part.fitted:
        result["prefill_attention_mfu"] = c.prefill_attention_mfu  # null stays null: at prefill_mfu
    kept = dict(part.kept)
    if "prefill_layer_host_s" in part.fitted:
        result["prefill_overhead_s"] = 0.0
        kept["prefill_overhead_s"] = "0: the host's launches (prefill_layer_host_s) describe the fixed time"
    return Part(result, part.fitted, kept)


def _fit_train(cfg, device, points, values, weights_at) -> Part:
    c = cfg.costs
    if not points:
        return Part({}, (), dict.fromkeys(TRAIN, "no training points"))
    setup = measured_setup(
        cfg,
        hbm_efficiency=values["hbm_efficiency"],
        train_mfu=TRAIN_MFU_CAP,
        train_layer_host_s=0.0,
        train_attention_mfu=None,
    )
    flops, share, rest, layers = [], [], [], []
    for _, spec, p in points:
        parts = train_layout.step(setup, spec, device, [p.seq_len], 1)
        flops.append(parts.train_compute_s * TRAIN_MFU_CAP)  # the passes' seconds at train_mfu = 1
        split = train_layout.forward_split(spec, [p.seq_len])  # no recompute: every pass has the forward's split
        share.append(split.attention / (split.matmul + split.attention))
        rest.append(parts.total_s - parts.train_compute_s)  # the optimizer's
        layers.append(spec.layers)
    flops, share, rest, layers = np.array(flops), np.array(share), np.array(rest), np.array(layers, dtype=float)
    t = np.array([p.seq_len / p.tokens_per_s for _, _, p in points])

    def predict(v: dict[str, float]) -> np.ndarray:
        compute = flops * ((1 - share) / v["train_mfu"] + share / v["train_attention_mfu"])
        return np.hypot(compute, layers * v["train_layer_host_s"]) + rest

    params = [
        Param("train_mfu", c.train_mfu, TRAIN_MFU_CAP),
        Param("train_layer_host_s", c.train_layer_host_s, _slowest(t, layers)),
        Param("train_attention_mfu", c.train_attention_mfu or c.train_mfu, TRAIN_MFU_CAP),
    ]
    part = fit_part(predict, t, params, "training")
    result = {**{p.name: p.default for p in params}, **part.values}
    if "train_attention_mfu" not in part.fitted:
        result["train_attention_mfu"] = c.train_attention_mfu  # null stays null: at train_mfu
    return Part(result, part.fitted, part.kept)


def _fit_logprob(cfg, device, points, values, weights_at) -> Part:
    c = cfg.costs
    if not points:
        return Part({}, (), dict.fromkeys(LOGPROB, "no log-prob points"))
    split = [train_layout.forward_split(spec, [p.seq_len]) for _, spec, p in points]
    matmul, attention = np.array([f.matmul for f in split]), np.array([f.attention for f in split])
    layers = np.array([spec.layers for _, spec, _ in points], dtype=float)
    t = np.array([p.seq_len / p.tokens_per_s for _, _, p in points])
    peak = device.peak_tflops * 1e12

    def predict(v: dict[str, float]) -> np.ndarray:
        compute = matmul / (peak * v["logprob_mfu"]) + attention / (peak * v["logprob_attention_mfu"])
        return np.hypot(compute, layers * v["logprob_layer_host_s"])

    params = _eager_pass_params("logprob", c, t, layers)
    part = fit_part(predict, t, params, "log-prob")
    result = {**{p.name: p.default for p in params}, **part.values}
    if "logprob_attention_mfu" not in part.fitted:
        result["logprob_attention_mfu"] = c.logprob_attention_mfu
    return Part(result, part.fitted, part.kept)


def _errors(cm: CostModel, setup: SimConfig, entry: profiles.ModelProfile) -> dict[str, float]:
    """Root-mean-square relative error of the calibrated roofline at each part's measured points, computed
    by the cost model itself (not by the fit's own formulas)."""
    c = setup.costs
    pairs = {
        "decode": [(cm.decode_step_s(p.batch, p.batch * p.context), p.step_s) for p in entry.decode],
        "prefill": [
            (cm.prefill_s(p.tokens, p.tokens * p.tokens / 2) + cm.prefill_overhead_s, p.seconds) for p in entry.prefill
        ],
        "train": [
            (train_layout.step(setup, cm.model, cm.device, [p.seq_len], 1).total_s, p.seq_len / p.tokens_per_s)
            for p in entry.train
        ],
        "logprob": [
            (
                train_layout.forward_s(
                    cm.model, cm.device, p.seq_len, c.logprob_mfu, c.logprob_attention_mfu, c.logprob_layer_host_s
                ),
                p.seq_len / p.tokens_per_s,
            )
            for p in entry.logprob
        ],
    }
    return {
        part: round(float(np.sqrt(np.mean([(s / m - 1) ** 2 for s, m in got]))), 6)
        for part, got in pairs.items()
        if got
    }
