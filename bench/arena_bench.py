"""Arena benchmark: release/refill of an experts-sized VMM arena against the PCIe limits.

    python bench/arena_bench.py --gib 16 --json out.json

Measures pinned host->device and device->host bandwidth with plain torch copies (the limit),
then maps an arena of --gib, fills it from a pinned HostCopy, releases it (NVML free before and
after), refills it (mapping + copy) and verifies the content. Prints a table and writes JSON
(hardware, versions, each figure with its limit and ratio). Targets are DESIGN.md section 8.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from limits import pinned_bandwidth_gb_s  # bench/limits.py, next to this file
from report import format_figures, write_json  # bench/report.py, next to this file

from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.backend import cuda_available
from strata.engine.core.memory.host_copy import HostCopy
from strata.engine.core.memory.vram import read_free_vram_bytes
from strata.units import GIB, MIB

RELEASE_TARGET_MS_PER_16_GIB = 20.0
REFILL_TARGET_RATIO = 0.85


def hardware_and_versions(device: torch.device) -> dict:
    import cuda.bindings

    info = {
        "gpu": torch.cuda.get_device_name(device),
        "total_vram_bytes": torch.cuda.get_device_properties(device).total_memory,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_bindings": getattr(cuda.bindings, "__version__", "unknown"),
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = version.decode() if isinstance(version, bytes) else version
    except Exception as exc:  # noqa: BLE001 - the version is only a label
        info["driver"] = f"unknown ({exc})"
    return info


def run(args: argparse.Namespace) -> dict:
    from strata.engine.core.memory.cuda_vmm import CudaVmmBackend

    backend = CudaVmmBackend(args.device)
    device = backend.device
    size = int(args.gib * GIB)
    h2d_gb_s, d2h_gb_s = pinned_bandwidth_gb_s(device, GIB, args.repeats)

    host = HostCopy(size, "bench host copy")
    torch.arange(size // 8, dtype=torch.int64, out=host.tensor(0, (size // 8,), torch.int64))
    t0 = time.perf_counter()
    is_pinned = host.pin(args.device)
    pin_s = time.perf_counter() - t0

    arena = Arena("experts", size, backend, chunk_bytes=args.chunk_mib * MIB)
    t0 = time.perf_counter()
    arena.map()
    map_s = time.perf_counter() - t0
    fill = host.copy_to(arena)
    arena.attach_host_copy(host)

    release_ms, refill_gb_s, freed_bytes, refill_map_ms = [], [], [], []
    for _ in range(args.cycles):
        torch.cuda.synchronize()
        free_before = read_free_vram_bytes(args.device)
        t0 = time.perf_counter()
        arena.release()
        release_ms.append((time.perf_counter() - t0) * 1e3)
        free_after = read_free_vram_bytes(args.device)
        if free_before is not None and free_after is not None:
            freed_bytes.append(free_after - free_before)
        result = arena.refill()
        refill_map_ms.append(result.map_s * 1e3)
        refill_gb_s.append(size / (result.map_s + result.copy_s) / 1e9)
    differing = host.count_differing_chunks(arena)
    arena.close()
    host.close()

    release_target_ms = RELEASE_TARGET_MS_PER_16_GIB * args.gib / 16
    median_release = statistics.median(release_ms)
    median_refill = statistics.median(refill_gb_s)
    figures = [
        ("pinned host->device", h2d_gb_s, "GB/s", None, None),
        ("pinned device->host", d2h_gb_s, "GB/s", None, None),
        ("pin host copy (register)", pin_s, "s", None, None),
        ("map arena", map_s * 1e3, "ms", None, None),
        ("fill from HostCopy", fill.gb_per_s, "GB/s", h2d_gb_s, fill.gb_per_s / h2d_gb_s),
        (
            "release (median)",
            median_release,
            "ms",
            release_target_ms,
            median_release / release_target_ms,
        ),  # ratio = value / limit everywhere; <= 1 here
        ("refill map part (median)", statistics.median(refill_map_ms), "ms", None, None),
        (
            "refill incl. mapping (median)",
            median_refill,
            "GB/s",
            h2d_gb_s,
            median_refill / h2d_gb_s,
        ),
    ]
    return {
        "benchmark": "arena",
        "command": " ".join(sys.argv),
        "hardware": hardware_and_versions(device),
        "params": {
            "gib": args.gib,
            "chunk_mib": args.chunk_mib,
            "cycles": args.cycles,
            "host_copy_pinned": is_pinned,
            "pin_note": host.pin_note,
        },
        "figures": [
            {"figure": name, "value": value, "unit": unit, "limit": limit, "ratio": ratio}
            for name, value, unit, limit, ratio in figures
        ],
        "raw": {
            "release_ms": release_ms,
            "refill_gb_s": refill_gb_s,
            "nvml_freed_bytes": freed_bytes,
            "refill_map_ms": refill_map_ms,
        },
        "targets": {
            "release_ms": release_target_ms,
            "refill_ratio": REFILL_TARGET_RATIO,
            "release_ok": median_release <= release_target_ms,
            "refill_ok": median_refill / h2d_gb_s >= REFILL_TARGET_RATIO,
        },
        "verify": {"differing_chunks": differing, "ok": differing == 0},
    }


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"{hw['gpu']} | driver {hw['driver']} | torch {hw['torch']} (CUDA {hw['torch_cuda']})")
    print(format_figures(report["figures"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="arena size in GiB (default 16)")
    parser.add_argument("--chunk-mib", type=int, default=512, help="mapping chunk (default 512)")
    parser.add_argument("--cycles", type=int, default=3, help="release/refill cycles (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="copies per bandwidth figure")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if not cuda_available():
        print(
            "arena_bench: no usable CUDA GPU or driver on this machine; run it where an "
            "NVIDIA GPU is present",
            file=sys.stderr,
        )
        return 2
    report = run(args)
    print_table(report)
    write_json(report, args.json)
    return 0 if report["verify"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
