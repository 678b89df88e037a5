"""Sweep block shapes of the grouped MoE decode kernels on Qwen3-30B-A3B shapes (one GPU).

    python bench/sweep_moe.py --json sweep_moe.json

Times (BLOCK_ROWS, BLOCK_COLS, num_warps, num_stages, UNROLL) shapes of fast/moe_triton.py's
two decode kernels with CUDA-graph replays, checks each against a float32 reference, and prints
the best; the winners are the candidate lists in moe_triton.py. About 150 s of compiling and
timing; shapes are tried in a shuffled order, so a deadline samples all of them.

Cold L2 (the default): each replay runs the kernel for COLD_SETS different sets of experts
in turn, so every launch reads weights that are not in the 50 MB L2, as in a decode step
(each layer's experts are read once per token). --warm replays one set, as the first sweep did
(its figures flattered shapes that only win when the weights are cached).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.fast import moe_triton

NUM_EXPERTS, INTERMEDIATE, HIDDEN, TOP_K = 128, 768, 2048, 8
ROWS, COLS, WARPS, STAGES = (1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8), (1, 3)
UNROLLS = (False, True)
COLD_SETS = 16  # 16 sets of 8 experts: 16 x 75 MB read per replay, far past the L2
MAX_TILE_ELEMENTS = 16384  # larger tiles spill registers
TIME_BOX_S = 150.0


def make_inputs(device: str = "cuda") -> dict[str, torch.Tensor]:
    def weights(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

    return {
        "gate": weights(NUM_EXPERTS, INTERMEDIATE, HIDDEN),
        "up": weights(NUM_EXPERTS, INTERMEDIATE, HIDDEN),
        "down": weights(NUM_EXPERTS, HIDDEN, INTERMEDIATE),
        "x": torch.randn(HIDDEN, device=device, dtype=torch.bfloat16),
        "ids": torch.randperm(NUM_EXPERTS, device=device)[:TOP_K].contiguous(),
        "id_sets": [torch.randperm(NUM_EXPERTS, device=device)[:TOP_K].contiguous()
                    for _ in range(COLD_SETS)],
        "weights": torch.rand(TOP_K, device=device, dtype=torch.bfloat16),
        "act": torch.randn(TOP_K, INTERMEDIATE, device=device, dtype=torch.bfloat16),
    }


def gate_up_launcher(t: dict, out: torch.Tensor, ids: torch.Tensor, config: tuple):
    rows, cols, warps, stages, unroll = config
    grid = (TOP_K, triton.cdiv(INTERMEDIATE, rows))
    return lambda: moe_triton._gate_up_kernel[grid](
        t["x"], t["gate"], t["up"], ids, out, t["gate"].stride(0), t["gate"].stride(1),
        num_cols=HIDDEN, num_rows=INTERMEDIATE, BLOCK_ROWS=rows, BLOCK_COLS=cols,
        UNROLL=unroll, num_warps=warps, num_stages=stages,
    )


def down_sum_launcher(t: dict, out: torch.Tensor, ids: torch.Tensor, config: tuple):
    rows, cols, warps, stages, unroll = config
    grid = (triton.cdiv(HIDDEN, rows),)
    return lambda: moe_triton._down_sum_kernel[grid](
        t["act"], t["down"], ids, t["weights"], out, t["down"].stride(0),
        t["down"].stride(1), num_cols=INTERMEDIATE, num_rows=HIDDEN, top_k=TOP_K,
        BLOCK_ROWS=rows, BLOCK_COLS=cols, UNROLL=unroll, num_warps=warps, num_stages=stages,
    )


def run(deadline_s: float, cold: bool = True) -> dict[str, list]:
    t = make_inputs()
    gathered = {name: t[name][t["ids"]].float() for name in ("gate", "up", "down")}
    x = t["x"].float()
    references = {
        "gate_up": torch.nn.functional.silu(gathered["gate"] @ x) * (gathered["up"] @ x),
        "down_sum": ((gathered["down"] @ t["act"].float()[:, :, None]).squeeze(-1)
                     * t["weights"].float()[:, None]).sum(0),
    }
    outputs = {"gate_up": torch.empty(TOP_K, INTERMEDIATE, device="cuda", dtype=torch.bfloat16),
               "down_sum": torch.empty(HIDDEN, device="cuda", dtype=torch.bfloat16)}
    launchers = {"gate_up": gate_up_launcher, "down_sum": down_sum_launcher}
    bytes_read = {"gate_up": 2 * TOP_K * INTERMEDIATE * HIDDEN * 2,
                  "down_sum": TOP_K * HIDDEN * INTERMEDIATE * 2}
    results: dict[str, list] = {name: [] for name in launchers}
    configs = [c for c in itertools.product(ROWS, COLS, WARPS, STAGES, UNROLLS)
               if c[0] * c[1] <= MAX_TILE_ELEMENTS and not (c[4] and c[3] > 1)]  # unrolled: no stages
    random.Random(0).shuffle(configs)
    started_s = time.perf_counter()
    for config in configs:
        if time.perf_counter() - started_s > deadline_s:
            break
        for name, make in launchers.items():
            if name == "down_sum" and config[1] > 1024:  # wider than its 768 columns
                continue
            launch = make(t, outputs[name], t["ids"], config)
            try:
                launch()
                torch.cuda.synchronize()
            except triton.runtime.errors.OutOfResources as exc:
                results[name].append({"config": config, "error": str(exc)})
                continue
            error = (outputs[name].float() - references[name]).abs().max().item()
            id_sets = t["id_sets"] if cold else [t["ids"]]
            per_set = [make(t, outputs[name], ids, config) for ids in id_sets]

            def launch_all(per_set=per_set):
                for one in per_set:
                    one()

            us = do_bench_cudagraph(launch_all, rep=20) * 1e3 / len(id_sets)
            results[name].append({"config": config, "us": us, "cold_l2": cold,
                                  "gb_s": bytes_read[name] / us / 1e3, "max_abs_error": error})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every timing here")
    parser.add_argument("--deadline-s", type=float, default=TIME_BOX_S)
    parser.add_argument("--warm", action="store_true", help="replay one expert set (warm L2)")
    args = parser.parse_args()
    results = run(args.deadline_s, cold=not args.warm)
    for name, rows in results.items():
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"{name}: best of {len(timed)} (BLOCK_ROWS, BLOCK_COLS, warps, stages, UNROLL)")
        for r in timed[:8]:
            print(f"  {r['config']}  {r['us']:7.2f} us  {r['gb_s']:6.0f} GB/s  "
                  f"err {r['max_abs_error']:.2g}")
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
