"""One MoE layer's prefill chunk over quantized experts on the GPU (issues 19, 52): the grouped
kernels that decode GGML blocks in their K loop (quant/expert_gemm.py), the int8 products
(quant/expert_mmq.py, opt-in STRATA_EXPERT_MMQ=1) and the other path
(quant/expert_grouped.py: experts dequantized a group at a time into a bf16 scratch, then
torch._grouped_mm), per GGML type, at Qwen3-30B-A3B's shape by default or GLM-4.5-Air's
(--shape glm-4.5-air: hidden 4096, experts 1408 wide, 128 of them, top-8; gate and up Q4_K,
down Q5_0 or Q8_0, as its Q4_K_M file). (Per token count, to read expert_gemm's crossover
off: bench/diag_dequant.py --part moe.)

All run the engine's code for the layer (moe_prefill.moe_block: router, sort by expert,
experts, weighted sum), on random blocks and random tokens; "gemm" is expert_gemm, forced
by raising the crossover; "mmq" expert_mmq, by STRATA_EXPERT_MMQ=1; "mix" expert_mmq's gate/up
and expert_gemm's down (STRATA_EXPERT_MMQ=gate_up); "old" the grouped path, forced by
switching moe_prefill.decodes_in_gemm off. --graphs times each path replayed from a CUDA
graph (the GPU's time alone, as the engine's prefill graphs run them) instead of called.
Prints one row per type and token count (microseconds per layer, each path's speed-up over
old, the matrix TFLOP/s, the tiles the autotuner chose, the largest difference from old),
then one JSON line. A type is one
name for all three projections or GATE_UP/DOWN (Q4_K/Q5_0). The first run compiles and
autotunes every tile candidate (Triton's disk cache keeps them for the next);
--first-config skips the autotuning for a quick check.

    python bench/diag_moe_prefill.py [--types Q4_K,Q6_K] [--tokens 512,4096] [--first-config]
    python bench/diag_moe_prefill.py --shape glm-4.5-air --tokens 512,4096
    python bench/diag_moe_prefill.py --shape glm-4.5-air --tokens 512 --profile
    python bench/diag_moe_prefill.py --shape glm-4.5-air --tokens 512,4096 --graphs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from limits import time_s  # bench/limits.py, next to this file


def _random_experts(qtype, num_experts: int, rows: int, cols: int):
    from strata.engine.core.quant.experts import QuantizedExperts

    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (num_experts, rows, cols // block_size * block_bytes),
                           dtype=torch.uint8, device="cuda")
    blocks &= 0x3F  # small bytes everywhere: every fp16 scale finite (diag_quant_gemv.py)
    return QuantizedExperts(qtype, (num_experts, rows, cols), blocks, torch.bfloat16)


def _set_experts(moe, stacks) -> None:
    for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
        if name in moe.experts._parameters:
            del moe.experts._parameters[name]
        setattr(moe.experts, name, stack)


def _chosen(tuned) -> str:
    config = getattr(tuned, "best_config", None)
    if config is None:
        return "-"
    kw = config.kwargs
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_ROWS']}x{kw['BLOCK_COLS']}/w{config.num_warps}"
            f"/s{kw['STAGES']}")


# name: (experts, hidden, expert width, top-k, default types)
SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8, "Q4_K,Q6_K"),
          "glm-4.5-air": (128, 4096, 1408, 8, "Q4_K/Q5_0,Q4_K/Q8_0")}


def _types(name: str) -> tuple:
    """(gate and up type, down type) of a --types entry: Q4_K or Q4_K/Q5_0."""
    gate_up, _, down = name.partition("/")
    return GGMLQuantizationType[gate_up], GGMLQuantizationType[down or gate_up]


# path: (STRATA_EXPERT_MMQ, expert_gemm switched off). "gemm": expert_gemm; "mmq": the int8
# products; "mix": int8 gate/up, expert_gemm's down; "old": the dequantizing path.
PATHS = {"gemm": (None, False), "mmq": ("1", False), "mix": ("gate_up", False),
         "old": (None, True)}


@contextlib.contextmanager
def _path(moe_prefill, name: str):
    """moe_block by one of PATHS while inside."""
    mmq, dequant = PATHS[name]
    decodes = moe_prefill.decodes_in_gemm
    if mmq:
        os.environ["STRATA_EXPERT_MMQ"] = mmq
    if dequant:
        moe_prefill.decodes_in_gemm = lambda *stacks: False
    try:
        yield
    finally:
        os.environ.pop("STRATA_EXPERT_MMQ", None)
        moe_prefill.decodes_in_gemm = decodes


def _time_path(moe_prefill, moe, x, repeats: int, name: str, graphs: bool):
    """(output, microseconds per layer) of moe_block by one path, called, or replayed from
    a CUDA graph (graphs: the GPU's time alone, as a prefill graph runs it)."""
    with _path(moe_prefill, name):
        out = moe_prefill.moe_block(moe, x)  # compiles and autotunes
        if not graphs:
            return out, time_s(lambda: moe_prefill.moe_block(moe, x), repeats) * 1e6
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_prefill.moe_block(moe, x)
        return out, time_s(graph.replay, repeats) * 1e6


def _profile_paths(moe_prefill, moe, x, title: str) -> None:
    """Each path's kernels in one layer call (where the layer's time goes besides the GEMMs:
    routing, sorting, the weighted sum)."""
    from diag_dequant import _profile

    for name in PATHS:
        with _path(moe_prefill, name):
            _profile(f"{title}, {name}", lambda: moe_prefill.moe_block(moe, x))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--types", help="comma-separated; default: the shape's")
    parser.add_argument("--experts", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--inter", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--tokens", default="512", help="comma-separated token counts")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", action="store_true",
                        help="also each path's kernels by torch.profiler (diag_dequant's table)")
    parser.add_argument("--graphs", action="store_true",
                        help="time each path replayed from a CUDA graph, not called")
    parser.add_argument("--first-config", action="store_true",
                        help="no autotuning: each kernel's first tile candidate")
    args = parser.parse_args()
    started_s = time.perf_counter()
    import triton

    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant import expert_gemm, expert_grouped, expert_mmq

    if args.first_config:
        for tuned in (expert_gemm._gate_up_tuned, expert_gemm._down_tuned,
                      expert_mmq._gate_up_tuned, expert_mmq._down_tuned):
            tuned.configs = tuned.configs[:1]
    shape = SHAPES[args.shape]
    e, h, i, k = (given or default for given, default in zip(
        (args.experts, args.hidden, args.inter, args.top_k), shape))
    moe = SparseMoE(h, i, e, k, True).cuda().bfloat16()
    # "gemm": expert_gemm at any count, called or inside a capture (--graphs: a capture
    # takes the replayed crossover, 8 rows an expert, which would time "old" under its name).
    expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = 1 << 30
    expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT = 1 << 30
    rows = []
    print(f"{'experts':10} {'tokens':>6} " + " ".join(f"{n + '_us':>9}" for n in PATHS)
          + f" {'gemm_x':>6} {'mmq_x':>6} {'mix_x':>6} {'mmq_TF/s':>8}  gemm tiles | "
          "mmq tiles   max_diff gemm, mmq, mix")
    for type_name in (args.types or shape[4]).split(","):
        gate_up_type, down_type = _types(type_name)
        _set_experts(moe, [_random_experts(gate_up_type, e, i, h),
                           _random_experts(gate_up_type, e, i, h),
                           _random_experts(down_type, e, h, i)])
        stacks = (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
        assert moe_prefill.decodes_in_gemm(*stacks) and expert_mmq.supports(*stacks)
        for t in (int(n) for n in args.tokens.split(",")):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            flops = 2 * t * k * 3 * h * i  # the routed rows' three projections
            outs, us = {}, {}
            for name in PATHS:
                outs[name], us[name] = _time_path(moe_prefill, moe, x, args.repeats, name,
                                                  args.graphs)
            old, old_us = outs["old"], us["old"]
            scale = old.float().abs().max().item()
            diffs = {n: (outs[n].float() - old.float()).abs().max().item()
                     for n in ("gemm", "mmq", "mix")}
            row = {"experts": type_name, "tokens": t, "graphs": args.graphs,
                   **{f"{n}_us": round(us[n], 1) for n in PATHS},
                   **{f"{n}_speedup": round(old_us / us[n], 2) for n in ("gemm", "mmq", "mix")},
                   "mmq_tflops": round(flops / us["mmq"] / 1e6, 1),
                   "gemm_tiles": f"{_chosen(expert_gemm._gate_up_tuned)} / "
                                 f"{_chosen(expert_gemm._down_tuned)}",
                   "mmq_tiles": f"{_chosen(expert_mmq._gate_up_tuned)} / "
                                f"{_chosen(expert_mmq._down_tuned)}",
                   **{f"{n}_rel_diff": round(d / max(scale, 1e-30), 5)
                      for n, d in diffs.items()}}
            rows.append(row)
            if args.profile:
                _profile_paths(moe_prefill, moe, x, f"{type_name} {t} tokens")
            print(f"{type_name:10} {t:6d} " + " ".join(f"{us[n]:9.1f}" for n in PATHS)
                  + f" {row['gemm_speedup']:6.2f} {row['mmq_speedup']:6.2f} "
                  f"{row['mix_speedup']:6.2f} {row['mmq_tflops']:8.1f}  {row['gemm_tiles']} | "
                  f"{row['mmq_tiles']}   " + ", ".join(f"{d:.4g}" for d in diffs.values())
                  + f" (of {scale:.3g})", flush=True)
    print(json.dumps({"figure": "moe_prefill_layer_us", "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "shape": {"name": args.shape, "experts": e, "hidden": h, "inter": i,
                                "top_k": k},
                      "autotuned": not args.first_config, "rows": rows,
                      "elapsed_s": round(time.perf_counter() - started_s, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
