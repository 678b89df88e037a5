"""How fast the staging gathers resident experts from their slots, as bytes or as wide rows.

    python bench/diag_staging_gather.py [--slots 6144] [--expert-bytes 1179648]
        [--experts 128] [--device cuda] [--json diag-gather.json]

A prefill over a partial expert cache copies each layer's resident experts from their slots
into the staging (memory/expert_staging.py) with index_select + index_copy_, GATHER_EXPERTS at
a time. Run 42's IQ2_XXS prefill that only gathered took ~3x the all-resident one. This times
one layer's gather of `--experts` experts (three projections of --expert-bytes / 3 each, from
slots scattered over a --slots arena) the way the staging did before wide_rows (uint8, one
byte an element) and the way it does now (expert_staging.wide_rows), and reports GB/s of
experts gathered against the device's own copy of the same bytes (one contiguous copy_).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.memory.expert_staging import GATHER_EXPERTS, wide_rows


def gather(staging: list[torch.Tensor], slots: list[torch.Tensor], experts: list[int],
           slot_of: list[int], device: torch.device) -> None:
    """The staging's gather (ExpertStaging._copy), over whatever views it is given."""
    for begin in range(0, len(experts), GATHER_EXPERTS):
        part = experts[begin: begin + GATHER_EXPERTS]
        dst_index = torch.tensor(part, dtype=torch.long).to(device, non_blocking=True)
        src_index = torch.tensor([slot_of[e] for e in part], dtype=torch.long).to(
            device, non_blocking=True)
        for dst, src in zip(staging, slots):
            dst.index_copy_(0, dst_index, src.index_select(0, src_index))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # the first call: kernels load, the caching allocator grows
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        started_s = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - started_s)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=6144, help="slots in the arena")
    p.add_argument("--expert-bytes", type=int, default=3 * 393216,
                   help="one expert's three projections (default: IQ2_XXS-like 30B-A3B)")
    p.add_argument("--experts", type=int, default=128, help="experts of the layer gathered")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    proj_bytes = args.expert_bytes // 3
    slots = [torch.empty(args.slots, proj_bytes, dtype=torch.uint8, device=device)
             for _ in range(3)]
    staging = [torch.empty(args.experts, proj_bytes, dtype=torch.uint8, device=device)
               for _ in range(3)]
    for s in slots:
        s.random_(0, 256)
    generator = torch.Generator().manual_seed(0)
    slot_of = torch.randperm(args.slots, generator=generator)[:args.experts].tolist()
    experts = list(range(args.experts))
    moved = args.experts * 3 * proj_bytes
    rows = {}
    for name, views in (("bytes", (staging, slots)),
                        ("wide_rows", tuple(zip(*(wide_rows(dst, src)
                                                  for dst, src in zip(staging, slots)))))):
        seconds = best_s(lambda v=views: gather(*v, experts, slot_of, device), device,
                         args.repeats)
        rows[name] = {"seconds": seconds, "gb_s": moved / seconds / 1e9,
                      "dtype": str(views[1][0].dtype)}
    # The same bytes gathered both ways must land the same (a check, not a timing).
    for dst, src in zip(staging, slots):
        assert torch.equal(dst, src[torch.tensor(slot_of, device=device)])
    flat_src = torch.empty(moved, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    copy_s = best_s(lambda: flat_dst.copy_(flat_src), device, args.repeats)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "slots": args.slots, "proj_bytes": proj_bytes, "experts": args.experts,
              "moved_bytes": moved, "copy_gb_s": moved / copy_s / 1e9, **rows}
    for name in ("bytes", "wide_rows"):
        row = rows[name]
        print(f"gather as {name:9s} ({row['dtype']}): {row['seconds'] * 1e3:7.2f} ms, "
              f"{row['gb_s']:7.1f} GB/s of experts")
    print(f"one contiguous copy of the same bytes: {report['copy_gb_s']:.1f} GB/s")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
