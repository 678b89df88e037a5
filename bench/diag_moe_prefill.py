"""One MoE layer's prefill chunk over quantized experts on the GPU (issue 19): the grouped
kernels that decode GGML blocks in their K loop (quant/expert_gemm.py) against the other
path (quant/expert_grouped.py: experts dequantized a group at a time into a bf16 scratch,
then torch._grouped_mm), per GGML type, at Qwen3-30B-A3B's shape by default. (Per token
count, to read the crossover off: bench/diag_dequant.py --part moe.)

Both run the engine's code for the layer (moe_prefill.moe_block: router, sort by expert,
experts, weighted sum), on random blocks and random tokens; "new" is expert_gemm, forced
by raising the crossover; "old" the grouped path, forced by switching
moe_prefill.decodes_in_gemm off. Prints one row per type (microseconds per layer,
the speed-up, the new path's matrix TFLOP/s, the tiles the autotuner chose, the largest
difference between the two outputs), then one JSON line. The first run compiles and
autotunes every tile candidate (Triton's disk cache keeps them for the next);
--first-config skips the autotuning for a quick check.

    python bench/diag_moe_prefill.py [--types Q4_K,Q6_K] [--tokens 512] [--first-config]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--first-config", action="store_true",
                        help="no autotuning: each kernel's first tile candidate")
    args = parser.parse_args()
    started_s = time.perf_counter()
    import triton

    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant import expert_gemm, expert_grouped

    if args.first_config:
        for tuned in (expert_gemm._gate_up_tuned, expert_gemm._down_tuned):
            tuned.configs = tuned.configs[:1]
    e, h, i, k, t = args.experts, args.hidden, args.inter, args.top_k, args.tokens
    moe = SparseMoE(h, i, e, k, True).cuda().bfloat16()
    expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = 1 << 30  # "new": expert_gemm at any count
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    flops = 2 * t * k * 3 * h * i  # the routed rows' three projections
    decodes = moe_prefill.decodes_in_gemm
    rows = []
    print(f"{'experts':8} {'tokens':>6} {'old_us':>9} {'new_us':>9} {'speedup':>7} "
          f"{'TFLOP/s':>7}  gate_up tile / down tile   max_diff")
    for type_name in args.types.split(","):
        qtype = GGMLQuantizationType[type_name]
        _set_experts(moe, [_random_experts(qtype, e, i, h), _random_experts(qtype, e, i, h),
                           _random_experts(qtype, e, h, i)])
        assert decodes(moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
        new = moe_prefill.moe_block(moe, x)  # compiles and autotunes
        new_us = time_s(lambda: moe_prefill.moe_block(moe, x), args.repeats) * 1e6
        moe_prefill.decodes_in_gemm = lambda *stacks: False
        try:
            old = moe_prefill.moe_block(moe, x)
            old_us = time_s(lambda: moe_prefill.moe_block(moe, x), args.repeats) * 1e6
        finally:
            moe_prefill.decodes_in_gemm = decodes
        diff = (new.float() - old.float()).abs().max().item()
        scale = old.float().abs().max().item()
        row = {"experts": type_name, "tokens": t, "old_us": round(old_us, 1),
               "new_us": round(new_us, 1), "speedup": round(old_us / new_us, 2),
               "new_tflops": round(flops / new_us / 1e6, 1),
               "gate_up_tile": _chosen(expert_gemm._gate_up_tuned),
               "down_tile": _chosen(expert_gemm._down_tuned),
               "max_abs_diff": round(diff, 5), "rel_diff": round(diff / max(scale, 1e-30), 5)}
        rows.append(row)
        print(f"{type_name:8} {t:6d} {old_us:9.1f} {new_us:9.1f} {row['speedup']:7.2f} "
              f"{row['new_tflops']:7.1f}  {row['gate_up_tile']} / {row['down_tile']}   "
              f"{diff:.4g} (of {scale:.3g})", flush=True)
    print(json.dumps({"figure": "moe_prefill_layer_us", "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "triton": triton.__version__,
                      "shape": {"experts": e, "hidden": h, "inter": i, "top_k": k,
                                "tokens": t},
                      "autotuned": not args.first_config, "rows": rows,
                      "elapsed_s": round(time.perf_counter() - started_s, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
