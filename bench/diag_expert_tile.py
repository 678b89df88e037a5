"""One expert_gemm kernel at one tile candidate, launched directly (no autotuner) at
Qwen3-30B-A3B's expert shape (E=128, H=2048, I=768) on random valid blocks (run 18).

Why: the IQ2_XXS file's load faulted inside the autotuner; this separates one candidate's
code from the autotuner's timing loop. Each launch is synchronized, so a fault names it.
Run it under compute-sanitizer for the faulting access. Prints one OK line with the mean
|output|, or dies with the CUDA error.

    python bench/diag_expert_tile.py down Q2_K --tile 32 128 4 64 2 [--rows 8] [--repeats 400]

KERNEL down|gate_up; --tile BLOCK_ROWS BLOCK_COLS num_warps BLOCK_M STAGES (expert_gemm's
candidate tuples); --rows routed rows: up to 8 all on expert 0 (the load's warm-up), more
spread evenly over the experts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from gguf import GGMLQuantizationType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from strata.engine.core.quant import expert_gemm as eg
from strata.engine.core.quant.lookup import lookup_table
from tests.helpers.quant_blocks import random_experts

EXPERTS, HIDDEN, INTER = 128, 2048, 768


def _offsets(rows: int) -> torch.Tensor:
    if rows <= 8:
        return torch.full((EXPERTS,), rows, dtype=torch.int32, device="cuda")
    counts = torch.full((EXPERTS,), rows // EXPERTS, dtype=torch.int32)
    counts[: rows % EXPERTS] += 1
    return counts.cumsum(0).to(torch.int32).cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=("down", "gate_up"))
    parser.add_argument("qtype", help="GGML type name, e.g. Q2_K")
    parser.add_argument("--tile", type=int, nargs=5, required=True,
                        metavar=("BLOCK_ROWS", "BLOCK_COLS", "WARPS", "BLOCK_M", "STAGES"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    qtype = GGMLQuantizationType[args.qtype]
    block_rows, block_cols, warps, block_m, stages = args.tile
    outputs, cols = (HIDDEN, INTER) if args.kernel == "down" else (INTER, HIDDEN)
    x = torch.randn(args.rows, cols, dtype=torch.bfloat16, device="cuda")
    offsets = _offsets(args.rows)
    out = torch.empty(args.rows, outputs, dtype=torch.bfloat16, device="cuda")
    grid = (triton.cdiv(outputs, block_rows), triton.cdiv(args.rows, block_m) + EXPERTS)
    meta = dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, BLOCK_M=block_m, STAGES=stages,
                num_warps=warps, NUM_EXPERTS=EXPERTS, BLOCK_E=triton.next_power_of_2(EXPERTS),
                PRECISION="native", USE_PDL=False)
    w = random_experts(qtype, EXPERTS, outputs, cols, 1, scale=0.02)
    lanes, unit = eg.decoding(w)
    hint = eg._rows_hint(args.rows, EXPERTS)
    table = lookup_table(x.device)
    if args.kernel == "down":
        def launch() -> None:
            eg._down_kernel[grid](
                x, offsets, w.raw, w.raw.view(torch.float16), table, out, args.rows, hint,
                w.expert_stride // unit, outputs, cols, w.raw.shape[2],
                QTYPE=int(qtype), LANES=lanes, UNIT=unit, **meta)
    else:
        u = random_experts(qtype, EXPERTS, outputs, cols, 2, scale=0.02)
        weights = torch.ones(args.rows, dtype=torch.bfloat16, device="cuda")

        def launch() -> None:
            eg._gate_up_kernel[grid](
                x, offsets, weights, w.raw, w.raw.view(torch.float16), u.raw,
                u.raw.view(torch.float16), table, out, args.rows, hint,
                w.expert_stride // unit, u.expert_stride // unit, outputs, cols,
                w.raw.shape[2], u.raw.shape[2], GATE_QTYPE=int(qtype), GATE_LANES=lanes,
                GATE_UNIT=unit, UP_QTYPE=int(qtype), UP_LANES=lanes, UP_UNIT=unit, **meta)
    for _ in range(args.repeats):
        launch()
        torch.cuda.synchronize()
    print(f"OK {args.kernel} {args.qtype} tile {args.tile} rows {args.rows} x{args.repeats}: "
          f"planes lanes {lanes}, unit {unit}, mean |out| {float(out.float().abs().mean()):.4g}")


if __name__ == "__main__":
    main()
