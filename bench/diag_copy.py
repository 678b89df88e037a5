"""Which host memory makes device-to-host copies fastest: a diagnostic for the session offload.

    python bench/diag_copy.py --json diag-copy.json

A session offload copies a KV cache (28 regions of 32 MiB for the lifecycle bench's 32k-token
session) out of the kv arena into the snapshot pool. Into registered pool memory that ran at
46.5 GB/s against 55 GB/s into `pin_memory`; this times each kind of host memory (torch's
pinned allocator, ordinary pages registered with cuMemHostRegister, the driver's
cuMemHostAlloc) against each kind of device memory (torch's allocator, a VMM arena), both
ways, as one flat copy and as the offload's region-sized pieces, on a side stream.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.memory.host_copy import HostCopy, side_stream
from strata.units import MIB

TOTAL_BYTES = 28 * 32 * MIB  # the lifecycle bench's 32k-token KV: 28 regions of 32 MiB
REGION_BYTES = 32 * MIB


def driver_host_alloc(nbytes: int) -> tuple[torch.Tensor, object]:
    """A uint8 tensor over cuMemHostAlloc'd (portable) memory, and what frees it."""
    from cuda.bindings import driver as cu

    err, address = cu.cuMemHostAlloc(nbytes, cu.CU_MEMHOSTALLOC_PORTABLE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemHostAlloc failed: {err}")
    buffer = (ctypes.c_uint8 * nbytes).from_address(int(address))
    return torch.frombuffer(buffer, dtype=torch.uint8), lambda: cu.cuMemFreeHost(address)


def host_buffers() -> dict[str, torch.Tensor]:
    registered = HostCopy(TOTAL_BYTES, name="registered")
    registered.tensor(0, (TOTAL_BYTES,), torch.uint8).fill_(1)  # touched, like a used pool
    registered.pin(0)
    untouched = HostCopy(TOTAL_BYTES, name="registered untouched")
    untouched.pin(0)
    alloc, _free = driver_host_alloc(TOTAL_BYTES)
    return {
        "pin_memory": torch.empty(TOTAL_BYTES, dtype=torch.uint8, pin_memory=True),
        "registered (filled first)": registered.tensor(0, (TOTAL_BYTES,), torch.uint8),
        "registered (untouched)": untouched.tensor(0, (TOTAL_BYTES,), torch.uint8),
        "cuMemHostAlloc": alloc,
        "_keep": (registered, untouched),  # type: ignore[dict-item]
    }


def device_buffers() -> dict[str, torch.Tensor]:
    arena = Arena("diag", TOTAL_BYTES, backend_for("cuda"), chunk_bytes=6 * MIB)
    arena.map()
    return {
        "torch allocator": torch.empty(TOTAL_BYTES, dtype=torch.uint8, device="cuda"),
        "vmm arena (6 MiB chunks)": arena.tensor(0, (TOTAL_BYTES,), torch.uint8),
        "_keep": arena,  # type: ignore[dict-item]
    }


def copy_ms(dst: torch.Tensor, src: torch.Tensor, piece_bytes: int, repeats: int = 7) -> float:
    """Median milliseconds of dst.copy_(src) in pieces of piece_bytes on the side stream."""
    stream = side_stream(torch.device("cuda", 0))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            start.record()
            for offset in range(0, TOTAL_BYTES, piece_bytes):
                dst[offset : offset + piece_bytes].copy_(
                    src[offset : offset + piece_bytes], non_blocking=True)
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    hosts, devices = host_buffers(), device_buffers()
    rows = []
    for host_name, host in hosts.items():
        if host_name.startswith("_"):
            continue
        for device_name, device in devices.items():
            if device_name.startswith("_"):
                continue
            for piece_bytes in (TOTAL_BYTES, REGION_BYTES):
                d2h = copy_ms(host, device, piece_bytes)
                h2d = copy_ms(device, host, piece_bytes)
                row = {"host": host_name, "device": device_name, "piece_mib": piece_bytes // MIB,
                       "d2h_gb_s": TOTAL_BYTES / d2h / 1e6, "h2d_gb_s": TOTAL_BYTES / h2d / 1e6}
                rows.append(row)
                print(f"{host_name:26} {device_name:26} {row['piece_mib']:4} MiB  "
                      f"D2H {row['d2h_gb_s']:5.1f} GB/s  H2D {row['h2d_gb_s']:5.1f} GB/s")
    write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
