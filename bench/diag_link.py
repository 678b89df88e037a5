"""What the host->GPU link gives a partial expert cache on this host, and what NUMA costs it.

    python bench/diag_link.py --json diag-link.json

Issue 54: two H100 hosts with the same bulk pinned copy rate (55 GB/s) ran the expert cache's
~1 MiB promotion copies at 15.2 and 9.6 GB/s and decoded at 83.5 and 50.2 tok/s. This prints
(a) the host: CPU, NUMA nodes, the GPU's node, PCIe link, IOMMU (link_topology.py); then, for
a host buffer made as HostCopy makes the expert copy (own pages, filled, registered DEVICEMAP)
with its pages left to first touch, bound to the GPU's node and bound to another node:
(b) where its pages sit (move_pages), (c) cudaMemcpyAsync rates by copy size, queued on the
side stream as promotion queues them, (d) a kernel reading the buffer in place through its
device address (as fast/moe_triton reads a missed expert) by total size and grid,
(e) (c)'s 1 MiB copies and (d) at once. Ratios: a copy size against 64 MiB copies; a read
against the best copy rate; contended against alone. Without a GPU it prints (a) and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from link_topology import format_topology, host_topology  # bench/, next to this file
from report import figure, format_figures, write_json

from strata.engine.core.memory import numa
from strata.engine.core.memory.host_copy import HostCopy, side_stream
from strata.units import KIB, MIB

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BUFFER_BYTES = 256 * MIB  # > L2 (50 MiB on an H100), so reads come over the link
COPY_SIZES_BYTES = tuple(64 * KIB << i for i in range(11))  # 64 KiB .. 64 MiB
MAX_COPIES = 2048  # per timed run: enough to queue, few enough to enqueue in milliseconds
READ_SIZES_BYTES = (MIB, 4 * MIB, 16 * MIB, 64 * MIB, 128 * MIB)  # 128: (e)'s read
READ_GRIDS_PER_SM = (1, 4, 16, 64)
TILE_INT32 = 1024  # 4 KiB a program reads per iteration: a few rows of a Q4_K expert
CONTENTION_COPY_BYTES = MIB  # a promotion copy of one Q4_K_M 30B-A3B projection
REPEATS = 5

if triton is not None:

    @triton.jit(do_not_specialize=["host_offset", "num_tiles", "iterations"])
    def _sum_in_place(base_ptr, host_offset, out_ptr, num_tiles, iterations,
                      TILE: tl.constexpr):
        """Program p sums tiles p, p + grid, ... of the int32s host_offset elements past
        base_ptr (the host buffer, as the expert kernels address it) into out[p]."""
        pid = tl.program_id(0)
        grid = tl.num_programs(0)
        cols = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.int32)
        end = num_tiles.to(tl.int64) * TILE
        for i in range(0, iterations):
            element = (pid + i * grid).to(tl.int64) * TILE + cols
            acc += tl.load(base_ptr + host_offset + element, mask=element < end, other=0)
        tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_in_place(base: torch.Tensor, host_offset: int, nbytes: int, grid: int,
                  out: torch.Tensor) -> None:
    """Launch _sum_in_place over nbytes (a multiple of 4 KiB) from host_offset int32s past
    `base`, with `grid` programs writing out[:grid]."""
    num_tiles = nbytes // (4 * TILE_INT32)
    iterations = -(-num_tiles // grid)
    _sum_in_place[(grid,)](base, host_offset, out, num_tiles, iterations, TILE=TILE_INT32)


def read_checks(base: torch.Tensor, host_offset: int, host: torch.Tensor) -> bool:
    """Whether the kernel's sum of host's first 64 KiB, read host_offset int32s past `base`,
    is torch's (int32 wrap-around both): the kernel reads what the buffer holds."""
    nbytes = 16 * 4 * TILE_INT32
    read_in_place(base, host_offset, nbytes, 4, base)
    expected = int(host[:nbytes].view(torch.int32).sum(dtype=torch.int64))
    got = int(base[:4].sum(dtype=torch.int64))
    wrap = lambda v: (v + 2**31) % 2**32 - 2**31  # noqa: E731
    return wrap(got) == wrap(expected)


def timed_ms(enqueue: Callable[[int], None], stream: torch.cuda.Stream, lead_ms: float,
             repeats: int = REPEATS) -> tuple[float, bool]:
    """Median device milliseconds of enqueue(run) on `stream`, behind a sleep of lead_ms so
    the host has queued it all before the device starts (the device's rate, not Python's);
    and whether queueing took longer than the sleep (then the figure is the host's)."""
    times, is_host_bound = [], False
    for run in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(lead_ms * 1.5e6))  # cycles at ~1.5 GHz; boost makes it less
            started_s = time.perf_counter()
            start.record()
            enqueue(run)
            end.record()
            queued_ms = (time.perf_counter() - started_s) * 1e3
        end.synchronize()
        times.append(start.elapsed_time(end))
        is_host_bound |= run > 0 and queued_ms > lead_ms / 2
    return statistics.median(times[1:]), is_host_bound  # the first warms up


class LinkBench:
    """One registered host buffer and a device buffer; times copies and in-place reads."""

    def __init__(self, host: HostCopy, device: torch.device):
        self.host, self.device = host, device
        self.src = host.tensor(0, (BUFFER_BYTES,), torch.uint8)
        self.dst = torch.empty(BUFFER_BYTES, dtype=torch.uint8, device=device)
        self.out = torch.empty(1 << 16, dtype=torch.int32, device=device)
        address = host.device_address_of(self.src)
        if address is None:
            raise RuntimeError(f"{host.name} has no device address: {host.pin_note}")
        self.host_offset = (address - self.out.data_ptr()) // 4  # int32s from out to it
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def enqueue_copies(self, size_bytes: int, first_byte: int = 0,
                       span_bytes: int = BUFFER_BYTES) -> Callable[[int], None]:
        """Copies of size_bytes from [first_byte, +span_bytes), each run another stretch."""
        count = min(span_bytes // size_bytes, MAX_COPIES)

        def enqueue(run: int) -> None:
            for i in range(count):
                at = first_byte + ((run * count + i) * size_bytes) % span_bytes
                self.dst[at : at + size_bytes].copy_(self.src[at : at + size_bytes],
                                                      non_blocking=True)
        enqueue.nbytes = count * size_bytes  # type: ignore[attr-defined]
        return enqueue

    def enqueue_read(self, nbytes: int, grid: int, first_byte: int = 0,
                     span_bytes: int = BUFFER_BYTES) -> Callable[[int], None]:
        """An in-place read of nbytes from [first_byte, +span_bytes), each run another one
        (reads of <= L2 would otherwise come from L2 the second time)."""
        def enqueue(run: int) -> None:
            at = first_byte + (run * nbytes) % span_bytes
            read_in_place(self.out, self.host_offset + at // 4, nbytes, grid, self.out)
        return enqueue

    def copy_rates(self) -> list[dict[str, Any]]:
        """(c): GB/s of queued copies by size, on the side stream."""
        rows = []
        for size in COPY_SIZES_BYTES:
            enqueue = self.enqueue_copies(size)
            nbytes: int = enqueue.nbytes  # type: ignore[attr-defined]
            lead_ms = 2 + 0.05 * (nbytes // size)
            ms, is_host_bound = timed_ms(enqueue, side_stream(self.device), lead_ms)
            rows.append({"copy_bytes": size, "num_copies": nbytes // size,
                         "gb_s": nbytes / ms / 1e6, "us_per_copy": ms * 1e3 / (nbytes // size),
                         "is_host_bound": is_host_bound})
        return rows

    def read_rates(self) -> list[dict[str, Any]]:
        """(d): GB/s of the in-place read by total size and grid, on the compute stream."""
        rows = []
        for nbytes in READ_SIZES_BYTES:
            for per_sm in READ_GRIDS_PER_SM:
                grid = per_sm * self.num_sms
                ms, is_host_bound = timed_ms(self.enqueue_read(nbytes, grid),
                                             torch.cuda.current_stream(), 2)
                rows.append({"read_bytes": nbytes, "grid": grid, "gb_s": nbytes / ms / 1e6,
                             "is_host_bound": is_host_bound})
        return rows

    def contention(self, grid: int) -> dict[str, Any]:
        """(e): 1 MiB copies of the buffer's first half on the side stream while the compute
        stream reads its second half in place; each stream's rate, and both's together."""
        half = BUFFER_BYTES // 2
        copies = self.enqueue_copies(CONTENTION_COPY_BYTES, 0, half)
        read = self.enqueue_read(half, grid, half, half)
        compute, side = torch.cuda.current_stream(), side_stream(self.device)
        results: dict[str, list[float]] = {"copy_ms": [], "read_ms": [], "both_ms": []}
        for run in range(REPEATS + 1):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            copied, read_done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda._sleep(int(20 * 1.5e6))  # both queued before either starts
            start.record(compute)
            side.wait_event(start)
            with torch.cuda.stream(side):
                copies(run)
                copied.record()
            read(run)
            read_done.record()
            torch.cuda.synchronize()
            if run:
                copy_ms, read_ms = start.elapsed_time(copied), start.elapsed_time(read_done)
                results["copy_ms"].append(copy_ms)
                results["read_ms"].append(read_ms)
                results["both_ms"].append(max(copy_ms, read_ms))
        ms = {k: statistics.median(v) for k, v in results.items()}
        copy_bytes = copies.nbytes  # type: ignore[attr-defined]
        return {"copy_bytes": CONTENTION_COPY_BYTES, "grid": grid,
                "copy_gb_s": copy_bytes / ms["copy_ms"] / 1e6,
                "read_gb_s": half / ms["read_ms"] / 1e6,
                "both_gb_s": (copy_bytes + half) / ms["both_ms"] / 1e6}


def measure_placement(label: str, node: int | None, device: torch.device) -> dict[str, Any]:
    """(b)-(e) for one buffer: bound to `node` (MPOL_BIND) before first touch, or left to
    first touch (None)."""
    host = HostCopy(BUFFER_BYTES, name=f"diag buffer ({label})")
    result: dict[str, Any] = {"label": label, "bound_node": node}
    try:
        if node is not None:
            numa.bind_pages(host.tensor(0, (1,), torch.uint8).data_ptr(), BUFFER_BYTES, node,
                            numa.MPOL_BIND)
        host.tensor(0, (BUFFER_BYTES,), torch.uint8).copy_(
            torch.randint(0, 256, (BUFFER_BYTES,), dtype=torch.uint8))  # filled, as experts are
        if not host.pin(device.index or 0):
            return {**result, "error": host.pin_note}
        result["pages_by_node"] = host.placement.pages_by_node  # sampled after the fill
        bench = LinkBench(host, device)
        result["copies"] = bench.copy_rates()
        result["reads"] = bench.read_rates()
        best_read = max(result["reads"], key=lambda r: r["gb_s"] if r["read_bytes"] >= 16 * MIB
                        else 0)
        result["contention"] = bench.contention(best_read["grid"])
        result["read_checks"] = read_checks(bench.out, bench.host_offset, bench.src)
    except (OSError, RuntimeError) as exc:  # one placement's failure keeps the others
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        host.close()
    return result


def placement_figures(row: dict[str, Any]) -> list[dict]:
    """report.figure rows of one placement, for the printed table."""
    if "error" in row:
        return [figure(f"{row['label']}: {row['error']}", None, "")]
    label = row["label"]
    big = row["copies"][-1]["gb_s"]
    host = {True: " (host-bound)", False: ""}  # queueing outran the lead: not the link's rate
    rows = [figure(f"{label} copy {c['copy_bytes'] // KIB} KiB{host[c['is_host_bound']]}",
                   c["gb_s"], "GB/s", big) for c in row["copies"]]
    rows += [figure(f"{label} read {r['read_bytes'] // MIB} MiB grid {r['grid']}"
                    f"{host[r['is_host_bound']]}", r["gb_s"], "GB/s", big) for r in row["reads"]]
    alone_copy = next(c["gb_s"] for c in row["copies"] if c["copy_bytes"] == CONTENTION_COPY_BYTES)
    both = row["contention"]
    alone_read = next(r["gb_s"] for r in row["reads"]
                      if r["grid"] == both["grid"] and r["read_bytes"] == BUFFER_BYTES // 2)
    rows += [figure(f"{label} contended: 1 MiB copies", both["copy_gb_s"], "GB/s", alone_copy),
             figure(f"{label} contended: read grid {both['grid']}", both["read_gb_s"], "GB/s",
                    alone_read),
             figure(f"{label} contended: both together", both["both_gb_s"], "GB/s", big)]
    return rows


def placements(topology: dict[str, Any]) -> list[tuple[str, int | None]]:
    """First touch, then the GPU's node, then one other node (each node if the GPU's is
    unknown) where the host has several."""
    result: list[tuple[str, int | None]] = [("first touch", None)]
    nodes = [n["node"] for n in topology["nodes"]]
    gpu_node = (topology["gpu"] or {}).get("numa_node")
    if gpu_node is not None:
        result.append((f"GPU node {gpu_node}", gpu_node))
        others = [n for n in nodes if n != gpu_node]
        if others:
            result.append((f"far node {others[0]}", others[0]))
    elif len(nodes) > 1:
        result += [(f"node {n}", n) for n in nodes]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--device", type=int, default=0, help="CUDA device index")
    args = parser.parse_args(argv)
    topology = host_topology(args.device)
    print(format_topology(topology))
    report: dict[str, Any] = {"topology": topology, "placements": []}
    if not torch.cuda.is_available() or triton is None:
        print("no CUDA device (or no Triton): only the host topology is measured")
        write_json(report, args.json)
        return 0
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    report["gpu_name"] = torch.cuda.get_device_name(device)
    report["placements"] = [measure_placement(label, node, device)
                            for label, node in placements(topology)]
    report["figures"] = [f for row in report["placements"] for f in placement_figures(row)]
    print(format_figures(report["figures"], limit_header="vs"))
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
