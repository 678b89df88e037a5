"""What giving KV pages back costs, and whether it waits for queued copies: an offload diagnostic.

    python bench/diag_unmap.py --json diag-unmap.json

The session offload (32k tokens, 0.88 GiB) ran at 40 GB/s against 55 GB/s for its copies
alone, and each region's pages are released as soon as that region's copy is done. This times,
for the same bytes: releasing chunk by chunk (cuMemUnmap + cuMemRelease each, as the arena
does) at several chunk sizes; one cuMemUnmap over a whole run of chunks, then the releases;
and one chunk's release while a long device-to-host copy of other memory is still queued
(if that waits for the copy, the driver synchronizes and early release cannot overlap).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from cuda.bindings import driver as cu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.memory.backend import backend_for
from strata.engine.core.memory.cuda_vmm import check
from strata.units import MIB

TOTAL_BYTES = 28 * 32 * MIB


def map_all(backend, reservation, chunk_bytes: int) -> list:
    handles = [backend.map_chunk(reservation, offset, chunk_bytes)
               for offset in range(0, TOTAL_BYTES, chunk_bytes)]
    backend.set_access(reservation, 0, TOTAL_BYTES)
    return handles


def release_each_ms(backend, reservation, chunk_bytes: int) -> float:
    handles = map_all(backend, reservation, chunk_bytes)
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    for i, handle in enumerate(handles):
        backend.unmap_chunk(reservation, i * chunk_bytes, chunk_bytes, handle)
    return (time.perf_counter() - started_s) * 1e3


def release_run_ms(backend, reservation, chunk_bytes: int) -> float | str:
    handles = map_all(backend, reservation, chunk_bytes)
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    (err,) = cu.cuMemUnmap(cu.CUdeviceptr(reservation.base_address), TOTAL_BYTES)
    if err != cu.CUresult.CUDA_SUCCESS:
        for i, handle in enumerate(handles):  # clean up the old way
            backend.unmap_chunk(reservation, i * chunk_bytes, chunk_bytes, handle)
        return f"refused: {err}"
    for handle in handles:
        check(cu.cuMemRelease(handle), "cuMemRelease")
    return (time.perf_counter() - started_s) * 1e3


def release_while_copying_ms(backend, reservation, chunk_bytes: int) -> dict[str, float]:
    """Queue ~70 ms of D2H copies of other memory, then time one chunk's release."""
    handles = map_all(backend, reservation, chunk_bytes)
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    queued_s = time.perf_counter()
    backend.unmap_chunk(reservation, 0, chunk_bytes, handles[0])
    release_s = time.perf_counter() - queued_s
    stream.synchronize()
    copy_s = time.perf_counter() - queued_s
    for i, handle in enumerate(handles[1:], start=1):
        backend.unmap_chunk(reservation, i * chunk_bytes, chunk_bytes, handle)
    return {"one_release_ms": release_s * 1e3, "queued_copy_ms": copy_s * 1e3}


def offload_pattern_ms(backend, reservation, chunk_bytes: int, mode: str) -> float:
    """28 region copies to pinned memory as an offload queues them, and the pages given back:
    "none" (copies only), "after" (all copies, then every release) or "early" (each region's
    release once its copy's event fired, while later copies run)."""
    region_bytes = 32 * MIB
    handles = map_all(backend, reservation, chunk_bytes)
    src = reservation.base_tensor[:TOTAL_BYTES]
    dst = torch.empty(TOTAL_BYTES, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    events = []
    with torch.cuda.stream(stream):
        for offset in range(0, TOTAL_BYTES, region_bytes):
            dst[offset : offset + region_bytes].copy_(src[offset : offset + region_bytes],
                                                      non_blocking=True)
            events.append(stream.record_event())
    per_region = region_bytes // chunk_bytes
    released = 0
    if mode == "early":
        for r, event in enumerate(events):
            event.synchronize()
            for i in range(r * per_region, (r + 1) * per_region):
                backend.unmap_chunk(reservation, i * chunk_bytes, chunk_bytes, handles[i])
            released = (r + 1) * per_region
    stream.synchronize()
    if mode == "none":
        elapsed_s = time.perf_counter() - started_s
    for i in range(released, len(handles)):
        backend.unmap_chunk(reservation, i * chunk_bytes, chunk_bytes, handles[i])
    if mode != "none":
        elapsed_s = time.perf_counter() - started_s
    return elapsed_s * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.cuda.init()
    backend = backend_for("cuda")
    reservation = backend.reserve(TOTAL_BYTES)
    results: dict = {}
    for chunk_mib in (4, 6, 8, 16, 32):
        chunk_bytes = chunk_mib * MIB
        if TOTAL_BYTES % chunk_bytes:
            continue
        release_each_ms(backend, reservation, chunk_bytes)  # warm-up
        results[f"release each, {chunk_mib} MiB chunks"] = release_each_ms(
            backend, reservation, chunk_bytes)
        results[f"one unmap then releases, {chunk_mib} MiB chunks"] = release_run_ms(
            backend, reservation, chunk_bytes)
    results["release during a queued copy (4 MiB chunk)"] = release_while_copying_ms(
        backend, reservation, 4 * MIB)
    for chunk_mib in (4, 8, 32):
        for mode in ("none", "after", "early", "none", "after", "early"):  # second pass counts
            results[f"offload pattern, {chunk_mib} MiB chunks, release {mode}"] = (
                offload_pattern_ms(backend, reservation, chunk_mib * MIB, mode))
    for name, value in results.items():
        print(f"{name:45} {value}")
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
