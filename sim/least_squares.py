"""Bounded least squares on relative error (sim/calibration.py): fit the constants the points pin down, keep the rest.

A constant is an efficiency in [FLOOR, its upper bound], fitted as its inverse (the seconds it multiplies, so the
model is linear in it where one term dominates), or seconds in [0, its upper bound]. Levenberg-Marquardt from a
few deterministic starts, bounds by clipping; each constant's relative standard error comes from the Jacobian at
the fit, and a constant above MAX_RELATIVE_SE is dropped (it keeps its default) and the fit redone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FLOOR = 1e-3  # the lowest efficiency a fit considers
MAX_RELATIVE_SE = 0.35  # a constant fitted with a larger standard error (relative) is not trusted
ITERATIONS = 200  # Levenberg-Marquardt steps at most


@dataclass(frozen=True)
class Part:
    """One part's fit (decode, prefill, ...): the values it set, the constants fitted, those kept and why."""

    values: dict[str, float]
    fitted: tuple[str, ...]
    kept: dict[str, str]


@dataclass(frozen=True)
class Param:
    """A constant to fit: an efficiency in [FLOOR, high], fitted as its inverse (the seconds it multiplies),
    or seconds (a name ending in _s) in [0, high]."""

    name: str
    default: float  # the config's value, kept when the points do not pin it down
    high: float  # the largest value (an efficiency's 1; seconds: several times the slowest point a layer)

    @property
    def seconds(self) -> bool:
        return self.name.endswith("_s")

    def to_x(self, value: float) -> float:
        return value if self.seconds else 1.0 / value

    def value(self, x: float) -> float:
        return float(x) if self.seconds else 1.0 / float(x)

    def bounds(self) -> tuple[float, float]:
        return (0.0, self.high) if self.seconds else (1.0 / self.high, 1.0 / FLOOR)


def fit_part(predict: Callable[[dict[str, float]], np.ndarray], t: np.ndarray, params: list[Param], part: str) -> Part:
    """Least squares of the relative error of `predict` over `params`; those the points do not pin down
    (relative standard error above MAX_RELATIVE_SE, or more of them than points) keep their defaults,
    dropped one at a time, the fit redone each time."""
    free = list(params)
    kept: dict[str, str] = {}
    while len(free) > len(t):
        p = free.pop()
        kept[p.name] = f"{len(t)} {part} point(s) do not pin down {len(free) + 1} constant(s)"
    fixed = {p.name: p.default for p in params}
    while free:
        values, se = _least_squares(predict, t, free, fixed)
        worst = max(range(len(free)), key=lambda i: (se[i], i))  # ties: the last
        if se[worst] <= MAX_RELATIVE_SE:
            return Part(values, tuple(p.name for p in free), kept)
        p = free.pop(worst)
        spread = "it has no say at the fit" if math.isinf(se[worst]) else f"standard error {se[worst]:.0%}"
        kept[p.name] = f"the {part} points do not pin it down ({spread}): the config's value"
    return Part({}, (), kept)


def _least_squares(predict, t, free: list[Param], fixed: dict[str, float]) -> tuple[dict, list[float]]:
    """Levenberg-Marquardt over the free constants (efficiencies as inverses, seconds as they are, each
    within its bounds) from a few deterministic starts; the fitted values (with the fixed ones) and each
    free constant's relative standard error from the Jacobian at the fit (linearised least squares; a
    constant at a bound or at 0 has an infinite one)."""
    lo, hi = (np.array(v) for v in zip(*(p.bounds() for p in free), strict=True))
    scale = np.array([p.high * 1e-3 if p.seconds else 1.0 for p in free])  # a typical size of each x

    def values_at(x: np.ndarray) -> dict[str, float]:
        return fixed | {p.name: p.value(v) for p, v in zip(free, np.clip(x, lo, hi), strict=True)}

    def residual(x: np.ndarray) -> np.ndarray:
        return predict(values_at(x)) / t - 1

    default = np.clip([p.to_x(p.default) if p.default else 0.0 for p in free], lo, hi)
    starts = [
        default,
        np.clip(np.where([p.seconds for p in free], scale, 2.0), lo, hi),
        np.clip(np.where([p.seconds for p in free], scale * 30, 5.0), lo, hi),
    ]
    x, _ = min((_lm(residual, x0, lo, hi, scale) for x0 in starts), key=lambda fit: fit[1])
    jac = _jacobian(residual, x, lo, hi, scale, at_bounds=False)
    r = residual(x)
    n, k = jac.shape
    var = float(r @ r) / max(1, n - k)
    size = np.maximum(np.abs(x), scale)  # columns in units of each constant's size: a fair condition number
    moving = jac.any(axis=0)
    se = [math.inf] * k
    sub = jac[:, moving] * size[moving]
    gram = sub.T @ sub
    if moving.any() and np.linalg.cond(gram) <= 1e12:
        for i, v in zip(np.flatnonzero(moving), np.sqrt(np.diag(np.linalg.inv(gram)) * var), strict=True):
            se[i] = float(v * size[i] / abs(x[i])) if x[i] else math.inf  # relative: of the inverse, or seconds
    return values_at(x), se


def _jacobian(residual, x, lo, hi, scale, at_bounds: bool = True) -> np.ndarray:
    """Forward differences (backward at the upper bound). Without `at_bounds`, a constant pressed against a
    bound gets a zero column: the fit could not move it there."""
    r0 = residual(x)
    jac = np.empty((len(r0), len(x)))
    for i in range(len(x)):
        step = np.zeros_like(x)
        step[i] = 1e-6 * max(abs(x[i]), scale[i])
        if x[i] + step[i] > hi[i]:
            step[i] = -step[i]
        jac[:, i] = (residual(x + step) - r0) / step[i]
        if not at_bounds and (x[i] <= lo[i] or x[i] >= hi[i]):
            jac[:, i] = 0.0
    return jac


def _lm(residual, x0, lo, hi, scale) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt with bounds by clipping: (x, sum of squares)."""
    x = np.clip(np.array(x0, dtype=float), lo, hi)
    r = residual(x)
    loss = float(r @ r)
    damping = 1e-3
    for _ in range(ITERATIONS):
        jac = _jacobian(residual, x, lo, hi, scale)
        grad, gram = jac.T @ r, jac.T @ jac
        moved = 0.0
        while damping <= 1e12:
            step = np.linalg.solve(gram + damping * np.diag(np.diag(gram) + 1e-30), -grad)
            trial = np.clip(x + step, lo, hi)
            r_trial = residual(trial)
            trial_loss = float(r_trial @ r_trial)
            if trial_loss < loss:
                moved = float(np.abs((trial - x) / np.maximum(np.abs(x), scale)).max())
                x, r, loss, damping = trial, r_trial, trial_loss, max(damping / 3, 1e-12)
                break
            damping *= 4
        if moved < 1e-10:
            break
    return x, loss
