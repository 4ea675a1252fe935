"""Timing code on a device, and the device's own ceilings: a square matrix product's FLOP/s and a copy's
bandwidth (on a GPU also to and from pinned host memory).

Both programs that measure real hardware for the simulator time with these: benchmarks/gpu_calibration.py (a
GPU's profile and peaks) and experiments/runtime_parts.py (one CPU core's device file, for `make validate`).
The module is in reference/ because it needs torch: core/ is pure Python and sim/ never imports torch, while
reference/ is the torch runtime whose costs these measure (and library code never imports from experiments/
or benchmarks/). A timed call on a GPU is bracketed by synchronisations, so it counts the kernels it launched.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes(device: torch.device) -> float:
    """Memory a measurement may still allocate: 90% of what the GPU has free; unchecked on a CPU."""
    return torch.cuda.mem_get_info(device)[0] * 0.9 if device.type == "cuda" else math.inf


def release(device: torch.device) -> None:
    """Collect garbage and hand the GPU's cached blocks back, so `free_bytes` sees them."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(run: Callable[[], object], device: torch.device, warmup: int, runs: int, pick=statistics.median) -> float:
    """Median (or `pick`) seconds of `runs` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + runs):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return pick(times)


def best_s(run: Callable[[], object], device: torch.device, warmup: int = 2, runs: int = 10) -> float:
    """The fastest of `runs` calls after `warmup` untimed ones: a ceiling."""
    return timed(run, device, warmup, runs, pick=min)


def seconds(run: Callable[[], object]) -> float:
    """Wall seconds of one call on the host (no device synchronisation)."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Peaks:
    matmul_tflops: float
    copy_gb_s: float  # bytes read + written, as a datasheet's bandwidth counts them
    host_to_device_gb_s: float | None  # None on a CPU
    device_to_host_gb_s: float | None


def matmul_tflops(side: int, device: torch.device, dtype: torch.dtype, warmup: int = 2, runs: int = 10) -> float:
    """TFLOP/s of the fastest `side` x `side` matrix product in `dtype`."""
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    return 2 * side**3 / best_s(lambda: a @ b, device, warmup, runs) / 1e12


def copy_gb_s(
    size: int, device: torch.device, warmup: int = 2, runs: int = 10
) -> tuple[float, float | None, float | None]:
    """GB/s of the fastest copy of `size` bytes within the device (read + written) and, on a GPU, from and to
    pinned host memory (None on a CPU)."""
    src = torch.ones(size, dtype=torch.uint8, device=device)  # written: a CPU's untouched pages would read as zeros
    dst = torch.empty_like(src)
    copy = 2 * size / best_s(lambda: dst.copy_(src), device, warmup, runs) / 1e9
    if device.type != "cuda":
        return copy, None, None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    h2d = size / best_s(lambda: src.copy_(host, non_blocking=True), device, warmup, runs) / 1e9
    d2h = size / best_s(lambda: host.copy_(src, non_blocking=True), device, warmup, runs) / 1e9
    return copy, h2d, d2h


def measure_peaks(device: torch.device, dtype: torch.dtype, side: int, size: int) -> Peaks:
    """The device's own ceilings: best of several runs of a `side`-square matrix product in `dtype`, a copy of
    `size` bytes within the device and, on a GPU, copies from and to pinned host memory."""
    peaks = Peaks(matmul_tflops(side, device, dtype), *copy_gb_s(size, device))
    release(device)
    return peaks
