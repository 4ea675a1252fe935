"""Calibrated costs: the roofline's efficiency constants fitted to what one device measured.

A profile (sim/profile.py; benchmarks/gpu_calibration.py writes one) holds decode step times, prefill
times and training throughput of models on one device. `costs.profile` names one; for the run's model
on `cluster.device`, `calibrate` fits the constants of sim/cost.py's roofline to the points by least
squares on relative error, in the setup the points were measured in (`profile.MEASURED_SETUP`: one
GPU), and the cost model then runs on the fitted values:

- decode: hbm_efficiency, decode_mfu, decode_step_overhead_s o and decode_seq_overhead_s s, from
  step = max(memory / hbm_efficiency, compute / decode_mfu) + o + s x batch at every (batch, context)
  (s only when the points span several batch sizes; it is the host's work per sequence: sampling,
  scheduling, streaming). Where the profile measured the device's copy bandwidth, the weights are read
  at that share of the datasheet's (`hbm_efficiency`, measured: a dense model reads the same weights at
  every step, so a fit cannot tell their rate from o) and the KV cache at `kv_hbm_efficiency`, fitted:
  step = max(weights / hbm_efficiency + KV / kv_hbm_efficiency, compute / decode_mfu) + o + s x batch;
- prefill: prefill_mfu and prefill_overhead_s f, from seconds = max(compute / prefill_mfu, weight reads /
  hbm_efficiency) + f (one prefill a point; f, an engine's fixed cost of a step that prefills, only
  with two or more points);
- training: train_mfu, from the trainer's step on one GPU (sim/train_layout.py; the points are measured
  without recompute, so model FLOPs run at 4/3 of train_mfu, the convention of HFU_PER_MFU);
- log-probs: logprob_mfu, from the trainer's forward-only pass over one sequence (seconds = forward
  FLOPs / (peak x logprob_mfu), train_layout's forward pass on one GPU).

Why fit constants rather than interpolate the points: a run asks for batches, contexts and layouts that
no profile measured (engines of 4 GPUs at 200 sequences of 3,000 tokens, ZeRO-3 over 32 GPUs); the
roofline with fitted efficiencies extrapolates along bytes and FLOPs, where an interpolation of a
one-GPU grid has nothing to say outside it. The price is the roofline's shape: what it cannot express
(a launch-bound prefill, attention kernels that slow at long context) remains as fit error, reported
per part (`rms_error`).

A constant no point constrains keeps the config's value, with the reason (`kept`): every constant of
a part with too few points; decode_mfu when every decode point is memory-bound (only a lower bound is
known, and the kept value is raised to it so the fit still holds); prefill_mfu likewise. The overheads
of training and the communication efficiencies are never calibrated: a profile measures one GPU. A
rollout pool of another device keeps the config's constants.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from core import config as cfgio
from core.specs import DeviceSpec, ModelSpec
from sim import profile as profiles
from sim import train_layout
from sim.config import SimConfig, config_dict
from sim.cost import CostModel

FLOOR = 1e-3  # the lowest efficiency a fit considers
GRID = 41  # points a side of each search grid
ROUNDS = 14  # each round narrows the grid to 4 of its steps: about 1e-14 of the range at the end
MIN_DECODE_POINTS = 3  # one per decode constant
MAX_RELATIVE_SE = 0.1  # a decode efficiency fitted with a larger standard error (relative) is not trusted
DECODE_OVERHEADS = ("decode_step_overhead_s", "decode_seq_overhead_s")  # a step's, and a sequence's in it


@dataclass(frozen=True)
class Calibration:
    """The constants a profile set for one model on one device, and how well the roofline fits it."""

    profile: str  # costs.profile as given
    device: str  # the device the profile names
    model: str  # the profile's entry for the run's model
    constants: dict[str, float | None]  # costs.<key> -> the value the cost model uses
    fitted: tuple[str, ...]  # keys of `constants` fitted to points; the others are `kept` or `measured`
    kept: dict[str, str]  # costs.<key> -> why the profile did not set it
    rms_error: dict[str, float]  # part -> root-mean-square relative error of the fitted roofline
    points: dict[str, int]  # part -> points measured
    measured: dict[str, str] = dataclasses.field(default_factory=dict)  # costs.<key> -> the measurement

    def apply(self, cfg: SimConfig) -> SimConfig:
        return dataclasses.replace(cfg, costs=dataclasses.replace(cfg.costs, **self.constants))

    def to_dict(self) -> dict:
        """For a run's provenance: fitted values, kept ones with their reason, fit errors."""
        return {
            "profile": self.profile,
            "device": self.device,
            "model": self.model,
            "fitted": {k: float(f"{self.constants[k]:.6g}") for k in self.fitted},
            "measured": {k: {"value": _short(self.constants[k]), "from": m} for k, m in self.measured.items()},
            "kept": {k: {"value": _short(self.constants[k]), "why": why} for k, why in self.kept.items()},
            "rms_relative_error": self.rms_error,
            "points": self.points,
        }


def _short(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.6g}")


def calibrate(cfg: SimConfig, model: ModelSpec, device: DeviceSpec) -> Calibration | None:
    """The constants `cfg.costs.profile` sets for `model` on `device`; None when there is no profile or
    the profile is of another device (a rollout pool's). SimConfig has checked the device and model."""
    name = cfg.costs.profile
    if name is None:
        return None
    profile = profiles.read_profile(name)
    if (profile.device.spec or "").lower() != device.name.lower():
        return None
    return _calibrate(cfg, model, device, profile)


@lru_cache(maxsize=16)
def _calibrate(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, profile: profiles.Profile) -> Calibration:
    name = cfg.costs.profile
    entry = profiles.entry_for(profile, model, cfg.model)
    c = cfg.costs
    values = {k: getattr(c, k) for k in ("hbm_efficiency", "decode_mfu", *DECODE_OVERHEADS)}
    values |= {"prefill_mfu": c.prefill_mfu, "prefill_overhead_s": c.prefill_overhead_s, "train_mfu": c.train_mfu}
    values["logprob_mfu"] = c.logprob_mfu
    values["kv_hbm_efficiency"] = c.kv_hbm_efficiency
    kept: dict[str, str] = {}
    fitted: list[str] = []
    measured: dict[str, str] = {}
    copy = profile.device.copy_gb_s
    weights_at = None if copy is None else min(1.0, copy / device.hbm_bandwidth_gb_s)
    setup = measured_setup(cfg, hbm_efficiency=1.0, decode_mfu=1.0, prefill_mfu=1.0, decode_step_overhead_s=0.0,
                           decode_seq_overhead_s=0.0)  # fmt: skip
    unit = CostModel(setup, model, device)  # every efficiency 1, no overhead: the bare roofline terms
    if weights_at is not None:
        values["hbm_efficiency"] = weights_at
        measured["hbm_efficiency"] = f"the device's copy: {copy:.6g} GB/s of the spec's {device.hbm_bandwidth_gb_s:g}"
    if len(entry.decode) >= MIN_DECODE_POINTS:
        decode = _fit_decode(unit, entry.decode, c, weights_at)
        values.update(decode.values)
        fitted += decode.fitted
        kept |= decode.kept
    else:
        why = f"{len(entry.decode)} decode point(s); the three decode constants need at least {MIN_DECODE_POINTS}"
        names = ("decode_mfu", *DECODE_OVERHEADS, *(("kv_hbm_efficiency",) if weights_at else ("hbm_efficiency",)))
        kept |= dict.fromkeys(names, why)
    if entry.prefill:
        prefill = _fit_prefill(unit, entry.prefill, values["hbm_efficiency"], c.prefill_mfu)
        values.update(prefill.values)
        fitted += prefill.fitted
        kept |= prefill.kept
    else:
        kept |= dict.fromkeys(("prefill_mfu", "prefill_overhead_s"), "no prefill points")
    if entry.train:
        values["train_mfu"] = _fit_train(cfg, model, device, entry.train, values["hbm_efficiency"])
        fitted.append("train_mfu")
    else:
        skipped = [why for why in entry.skipped if why.startswith("train")]
        kept["train_mfu"] = "no training points" + (f" ({'; '.join(skipped)})" if skipped else "")
    if entry.logprob:
        values["logprob_mfu"] = _fit_logprob(model, device, entry.logprob)
        fitted.append("logprob_mfu")
    else:
        kept["logprob_mfu"] = "no log-prob points"
    calibrated = measured_setup(cfg, **values)
    return Calibration(
        profile=name,
        device=profile.device.spec or profile.device.name,
        model=entry.model,
        constants=values,
        fitted=tuple(fitted),
        kept=kept,
        measured=measured,
        rms_error=_errors(CostModel(calibrated, model, device), calibrated, entry),
        points={part: len(getattr(entry, part)) for part in ("decode", "prefill", "train", "logprob")},
    )


def measured_setup(cfg: SimConfig, **costs: float) -> SimConfig:
    """`cfg` in the setup a profile was measured in (one GPU, ...), with these costs.* values."""
    data = cfgio.apply_overrides(config_dict(cfg), list(profiles.MEASURED_SETUP))
    data["costs"].update(costs)
    return cfgio.from_dict(SimConfig, data)


# ---- the fits ----


@dataclass(frozen=True)
class _Part:
    values: dict[str, float]
    fitted: tuple[str, ...]
    kept: dict[str, str]


def _fit_decode(unit: CostModel, points: tuple[profiles.DecodePoint, ...], c, weights_at: float | None) -> _Part:
    """The decode constants minimising the relative error of max(M/e, C/u) + o + s b: e is hbm_efficiency,
    reading weights and KV cache alike, or with `weights_at` (the weights' measured efficiency) e is
    kv_hbm_efficiency and M/e becomes W/weights_at + KV/e. u is decode_mfu, o and s the overheads of a
    step and of a sequence (s only when the points span several batch sizes)."""
    terms = np.array([unit.decode_memory_s(p.batch, p.batch * p.context) for p in points])
    compute = np.array([unit.decode_lines(p.batch, p.batch * p.context).p2 for p in points])
    if weights_at is None:
        name, fixed, memory = "hbm_efficiency", np.zeros(len(points)), terms.sum(axis=1)
        default = c.hbm_efficiency
    else:
        name, fixed, memory = "kv_hbm_efficiency", terms[:, 0] / weights_at, terms[:, 1]
        default = c.hbm_efficiency if c.kv_hbm_efficiency is None else c.kv_hbm_efficiency
    t = np.array([p.step_s for p in points])
    batch = np.array([float(p.batch) for p in points]) if len({p.batch for p in points}) > 1 else None
    e, u = _search(lambda es, us: _decode_loss(memory, compute, t, es, us, batch, fixed)[0], 2)
    overheads = [DECODE_OVERHEADS[0], *([DECODE_OVERHEADS[1]] if batch is not None else [])]

    def fixed_costs(e: float, u: float) -> dict[str, float]:
        _, o, per_seq = _decode_loss(memory, compute, t, np.array([e]), np.array([u]), batch, fixed)
        return {"decode_step_overhead_s": float(o[0]), "decode_seq_overhead_s": float(per_seq[0])}

    values = {name: e, "decode_mfu": u, **fixed_costs(e, u)}
    fitted, kept = [name, "decode_mfu", *overheads], {}
    bound = compute / u > fixed + memory / e
    worst = _worst_relative_se(memory, compute, t, e, u, values, batch, fixed)
    if worst > MAX_RELATIVE_SE:  # e.g. every point reads about the same bytes: e and overhead trade off
        e, u = default, c.decode_mfu
        spread = "they trade off exactly" if math.isinf(worst) else f"standard error {worst:.0%} of the value"
        why = f"the decode points do not pin the efficiencies down ({spread}): kept, and only "
        why += f"{' and '.join(overheads)} fitted"
        values = {name: e, "decode_mfu": u, **fixed_costs(e, u)}
        return _Part(values, tuple(overheads), dict.fromkeys((name, "decode_mfu"), why))
    if not bound.any():  # u only has a floor: the one above which every point stays memory-bound
        floor = float(np.max(compute / (fixed + memory / e)))
        values["decode_mfu"] = min(1.0, max(c.decode_mfu, floor))
        fitted.remove("decode_mfu")
        kept["decode_mfu"] = f"every decode point is memory-bound: only decode_mfu >= {floor:.3g} is known"
    elif bound.all():
        floor = float(np.max(memory / np.maximum(compute / u - fixed, 1e-30)))
        values[name] = min(1.0, max(default, floor))
        fitted.remove(name)
        kept[name] = f"every decode point is compute-bound: only {name} >= {floor:.3g} is known"
    return _Part(values, tuple(fitted), kept)


def _worst_relative_se(memory, compute, t, e: float, u: float, values: dict, batch, fixed) -> float:
    """The larger relative standard error of e and u (of those some point binds), from the residuals and
    the Jacobian of the relative residuals in (1/e, 1/u, o, s) at the fit (linearised least squares)."""
    overhead, per_seq = values["decode_step_overhead_s"], values["decode_seq_overhead_s"]
    mem_bound = fixed + memory / e >= compute / u
    columns = {"e": np.where(mem_bound, memory, 0.0) / t, "u": np.where(mem_bound, 0.0, compute) / t}
    columns = {k: v for k, v in columns.items() if v.any()}
    extra = [*([1.0 / t] if overhead > 0 else []), *([batch / t] if batch is not None and per_seq > 0 else [])]
    jac = np.column_stack([*columns.values(), *extra])
    n, k = jac.shape
    residual = (
        np.maximum(fixed + memory / e, compute / u) + overhead + per_seq * (0 if batch is None else batch) - t
    ) / t
    scale = float((residual**2).sum()) / max(1, n - k)
    if scale == 0.0:
        return 0.0
    gram = jac.T @ jac
    if np.linalg.cond(gram) > 1e12:
        return float("inf")
    se = np.sqrt(np.diag(np.linalg.inv(gram)) * scale)
    inverse = {"e": 1 / e, "u": 1 / u}
    return max(se[i] / inverse[key] for i, key in enumerate(columns))


def _decode_loss(memory, compute, t, es, us, batch=None, fixed=0.0):
    """Loss and the best overheads (each >= 0, closed form) of each (e, u) pair: (loss, o, s), arrays of the
    pairs' shape; s is 0 when `batch` is None (one batch size: it would only repeat o). `fixed`: seconds of
    the memory line read at a known rate (the weights, where the device's copy was measured)."""
    w = 1.0 / t
    r = (np.maximum(fixed + memory / es[..., None], compute / us[..., None]) - t) * w  # relative residual
    if batch is None:
        overhead = np.clip(-(r * w).sum(-1) / (w * w).sum(-1), 0.0, None)
        return ((r + overhead[..., None] * w) ** 2).sum(-1), overhead, np.zeros_like(overhead)
    # Least squares of r + o w + s (b w) in (o, s) >= 0: the 2x2 normal equations, then each bound alone.
    x = batch * w
    aa, ab, bb = (w * w).sum(), (w * x).sum(), (x * x).sum()
    ra, rb = -(r * w).sum(-1), -(r * x).sum(-1)
    det = aa * bb - ab * ab
    o = (ra * bb - rb * ab) / det
    per_seq = (rb * aa - ra * ab) / det
    only_o = np.clip(ra / aa, 0.0, None)  # s = 0
    only_s = np.clip(rb / bb, 0.0, None)  # o = 0

    def loss(o_, s_):
        return ((r + o_[..., None] * w + s_[..., None] * x) ** 2).sum(-1)

    candidates = [(np.where((o >= 0) & (per_seq >= 0), o, only_o), np.where((o >= 0) & (per_seq >= 0), per_seq, 0.0)),
                  (only_o, np.zeros_like(only_o)), (np.zeros_like(only_s), only_s)]  # fmt: skip
    losses = np.stack([loss(o_, s_) for o_, s_ in candidates])
    best = np.argmin(losses, axis=0)
    o_best = np.choose(best, [c[0] for c in candidates])
    s_best = np.choose(best, [c[1] for c in candidates])
    return losses.min(axis=0), o_best, s_best


def _fit_prefill(unit: CostModel, points: tuple[profiles.PrefillPoint, ...], hbm: float, default: float) -> _Part:
    """prefill_mfu u and prefill_overhead_s f minimising the relative error of max(C/u, M) + f (one prefill a
    point); f only with two or more points."""
    terms = np.array([unit.prefill_terms(p.tokens, p.tokens * p.tokens / 2) for p in points])
    compute, memory = terms[:, 0], terms[:, 1] / hbm
    t = np.array([p.seconds for p in points])
    w = 1.0 / t

    def loss(us):
        r = (np.maximum(compute / us[..., None], memory) - t) * w
        f = np.clip(-(r * w).sum(-1) / (w * w).sum(-1), 0.0, None) if len(points) > 1 else np.zeros(us.shape)
        return ((r + f[..., None] * w) ** 2).sum(-1), f

    (u,) = _search(lambda us: loss(us)[0], 1)
    overhead = float(loss(np.array([u]))[1][0])
    values = {"prefill_mfu": u, "prefill_overhead_s": overhead}
    fitted = ["prefill_mfu", *(["prefill_overhead_s"] if len(points) > 1 else [])]
    kept = {} if len(points) > 1 else {"prefill_overhead_s": "one prefill point: no fixed cost can be told apart"}
    if (compute / u > memory).any():
        return _Part(values, tuple(fitted), kept)
    floor = float(np.max(compute / memory))
    values["prefill_mfu"] = min(1.0, max(default, floor))
    fitted.remove("prefill_mfu")
    kept["prefill_mfu"] = f"every prefill point is bound by weight reads: only prefill_mfu >= {floor:.3g} is known"
    return _Part(values, tuple(fitted), kept)


def _fit_train(cfg: SimConfig, model: ModelSpec, device: DeviceSpec, points, hbm: float) -> float:
    """train_mfu m of seconds = A / m + R (A: the passes' compute at m = 1; R: the optimizer), closed form
    in 1/m, within (0, 0.75] (train_layout: MFU counted with full recompute runs at 4/3 of it)."""
    setup = measured_setup(cfg, hbm_efficiency=hbm, train_mfu=0.75)
    a, rest = [], []
    for p in points:
        parts = train_layout.step(setup, model, device, [p.seq_len], 1)
        a.append(parts.train_compute_s * 0.75)
        rest.append(parts.total_s - parts.train_compute_s)
    a, rest = np.array(a), np.array(rest)
    t = np.array([p.seq_len / p.tokens_per_s for p in points])
    inverse = float((a * (t - rest) / t**2).sum() / (a * a / t**2).sum())
    return 0.75 if inverse <= 1 / 0.75 else 1.0 / inverse


def _fit_logprob(model: ModelSpec, device: DeviceSpec, points) -> float:
    """logprob_mfu m of seconds = A / m (A: one forward's FLOPs at the device's peak), closed form in 1/m,
    within (0, 1]."""
    a = np.array([train_layout.forward_s(model, device, p.seq_len, 1.0) for p in points])
    t = np.array([p.seq_len / p.tokens_per_s for p in points])
    inverse = float((a * t / t**2).sum() / (a * a / t**2).sum())
    return min(1.0, 1.0 / inverse)


def _search(loss, dims: int) -> tuple[float, ...]:
    """The point of [FLOOR, 1]^dims with the least `loss`, by a log-spaced grid narrowed round by round
    around its best point (deterministic; the losses here are smooth and have one basin)."""
    lo, hi = np.full(dims, np.log(FLOOR)), np.zeros(dims)
    best = hi
    for _ in range(ROUNDS):
        axes = [np.linspace(lo[i], hi[i], GRID) for i in range(dims)]
        mesh = np.meshgrid(*axes, indexing="ij")
        values = loss(*(np.exp(m) for m in mesh))
        at = np.unravel_index(np.argmin(values), values.shape)
        best = np.array([m[at] for m in mesh])
        step = (hi - lo) / (GRID - 1)
        lo, hi = np.maximum(best - 2 * step, np.log(FLOOR)), np.minimum(best + 2 * step, 0.0)
    return tuple(float(v) for v in np.exp(best))


def _errors(cm: CostModel, setup: SimConfig, entry: profiles.ModelProfile) -> dict[str, float]:
    """Root-mean-square relative error of the calibrated roofline at each part's measured points."""
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
                train_layout.forward_s(cm.model, cm.device, p.seq_len, setup.costs.logprob_mfu),
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
