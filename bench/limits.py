"""The physical limits a speed figure is compared with, measured on the machine at hand."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

GIB = 1 << 30


def time_s(fn, repeats: int) -> float:
    """Seconds per call of fn on the current CUDA stream (CUDA events, after one warm-up)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def best_wall_s(fn, repeats: int) -> float:
    """Wall seconds of the fastest of `repeats` calls of fn, each between two device syncs
    (host time included: what a request waits), after one unmeasured warm call. Without
    CUDA (a CPU dry run) the calls are synchronous and nothing is synced."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        started_s = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started_s)
    return best


def best_cpu_s(fn: Callable[[], object], min_time_s: float = 0.2, rounds: int = 3) -> float:
    """Best mean wall seconds a call of a host-side fn (CPU kernels) over `rounds` rounds of at
    least min_time_s each, the calls per round calibrated first."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < min_time_s / 4:  # calibrate
        fn()
        calls += 1
    per_round = max(3, int(calls / (time.perf_counter() - t0) * min_time_s))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_round)
    return best


def hbm_bandwidth_gb_s(device: torch.device, nbytes: int = 2 * GIB, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth, counting the read and the write (GB/s)."""
    def copy_seconds() -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return time_s(lambda: dst.copy_(src), repeats)

    seconds = copy_seconds()
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds / 1e9


def matmul_tflop_s(device: torch.device, size: int = 8192, repeats: int = 20) -> float:
    """bf16 matrix-multiply rate of a square size^3 product (TFLOP/s)."""
    def matmul_seconds() -> float:
        a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
        b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(a)
        return time_s(lambda: torch.matmul(a, b, out=out), repeats)

    seconds = matmul_seconds()
    torch.cuda.empty_cache()
    return 2 * size**3 / seconds / 1e12


def pinned_bandwidth_gb_s(device: torch.device, nbytes: int = GIB, repeats: int = 5):
    """(host->device, device->host) GB/s between a pinned host buffer and device memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        results.append(repeats * nbytes / (time.perf_counter() - t0) / 1e9)
    del host, dev
    torch.cuda.empty_cache()
    return results[0], results[1]


def measure_limits(device: torch.device) -> dict:
    """HBM bandwidth, bf16 matrix rate and pinned PCIe bandwidth, as one dict."""
    h2d, d2h = pinned_bandwidth_gb_s(device)
    return {
        "hbm_gb_s": hbm_bandwidth_gb_s(device),
        "matmul_bf16_tflop_s": matmul_tflop_s(device),
        "pinned_h2d_gb_s": h2d,
        "pinned_d2h_gb_s": d2h,
    }
