"""How fast the staging gathers resident experts from their slots, against a plain copy.

    python bench/diag_staging_gather.py [--slots 6144] [--expert-bytes 1179648]
        [--experts 128] [--device cuda] [--json diag-gather.json]

A prefill over a partial expert cache copies each layer's resident experts from their slots
into the staging (memory/expert_staging.gather: index_select + index_copy_ over wide_rows).
Run 42's IQ2_XXS prefill that only gathered took ~3x the all-resident one, when the gather
still moved uint8 elements. This times expert_staging.gather for one layer's `--experts`
experts (three projections of --expert-bytes / 3 each, from slots scattered over a --slots
arena: past 2**31 bytes a projection by default) and reports GB/s of experts gathered
against the device's own copy of the same bytes (one contiguous copy_).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from limits import best_wall_s  # bench/limits.py, next to this file
from report import write_json

from strata.engine.core.memory.expert_staging import gather, wide_rows


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
    slots = [torch.empty(args.slots, proj_bytes, dtype=torch.uint8, device=device).random_(0, 256)
             for _ in range(3)]
    staging = [torch.empty(args.experts, proj_bytes, dtype=torch.uint8, device=device)
               for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    slot_of = torch.randperm(args.slots, generator=generator)[:args.experts].tolist()
    experts = list(range(args.experts))
    moved = args.experts * 3 * proj_bytes
    gather_s = best_wall_s(lambda: gather(staging, slots, experts, slot_of), args.repeats)
    # What the gather landed is what a direct index gives (a check, not a timing).
    for dst, src in zip(staging, slots):
        assert torch.equal(dst, src[torch.tensor(slot_of, device=device)])
    flat_src = torch.empty(moved, dtype=torch.uint8, device=device)
    flat_dst = torch.empty_like(flat_src)
    copy_s = best_wall_s(lambda: flat_dst.copy_(flat_src), args.repeats)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "slots": args.slots, "proj_bytes": proj_bytes, "experts": args.experts,
              "moved_bytes": moved, "element": str(wide_rows(staging[0], slots[0])[0].dtype),
              "gather_s": gather_s, "gather_gb_s": moved / gather_s / 1e9,
              "copy_gb_s": moved / copy_s / 1e9}
    print(f"gather ({report['element']} elements): {gather_s * 1e3:.2f} ms, "
          f"{report['gather_gb_s']:.1f} GB/s of experts; one contiguous copy of the same "
          f"bytes: {report['copy_gb_s']:.1f} GB/s")
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
