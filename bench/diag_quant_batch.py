"""Time of one Qwen3-30B-A3B-shaped MoE layer over quantized experts for a batch step of B
rows (issue 22), replayed from CUDA graphs: the batched kernels (quant/expert_batch.py: one
leader per routed expert decodes its blocks once for all its rows) against the one-token
kernels row by row (router + expert_gemv.routed_mlp per row, the path batches took before).

Prints one row per (expert types, B, path) with microseconds per layer, the distinct routed
experts' block bytes a step must read (each once) and that over the time, then the JSON.
Each graph replays GRAPH_LAYERS steps with other inputs (other routing), so the blocks come
from HBM, not the L2, as in a decode step's 48 layers. Random routers spread rows over the
experts about uniformly: the worst case for sharing.

    python bench/diag_quant_batch.py [--mixes Q4_K/Q4_K/Q6_K,Q4_K/Q4_K/Q4_K] [--rows 1,2,4,8,16]

Each mix compiles and autotunes its kernels first (about a minute on the H200 with cold
Triton caches).
"""

from __future__ import annotations

import argparse
import json

import torch
from diag_quant_experts import _graph_us, _random_experts  # bench/, next to this file
from gguf import GGMLQuantizationType

GRAPH_LAYERS = 16  # steps per graph replay, each routed to other experts
HBM_BYTES_PER_S = 4.3e12  # H200 (DESIGN.md §8)


def _moe(hidden: int, inter: int, num_experts: int, top_k: int, stacks):
    """A SparseMoE whose experts are the quantized stacks (as the loader builds them)."""
    from strata.engine.core.models.switch import SparseMoE

    moe = SparseMoE(hidden, inter, num_experts, top_k, True).cuda().bfloat16()
    for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
        del moe.experts._parameters[name]
        setattr(moe.experts, name, stack)
    return moe


def _distinct_bytes(moe, xs, stacks) -> float:
    """Mean bytes of the distinct experts a step's rows route to."""
    from strata.engine.core.fast.moe_batch import router_topk_rows

    per_expert = sum(s.nbytes for s in stacks) / stacks[0].num_experts
    counts = [len(set(router_topk_rows(x, moe.router.weight, moe.top_k, True)[1]
                      .flatten().tolist())) for x in xs]
    return per_expert * sum(counts) / len(counts)


def rows_for(mix: str, num_rows_list, args) -> list[dict]:
    from strata.engine.core.fast.batch_experts import experts_rows
    from strata.engine.core.fast.moe_batch import router_topk_rows
    from strata.engine.core.fast.moe_grouped import experts_triton
    from strata.engine.core.quant import expert_batch

    types = [GGMLQuantizationType[t] for t in mix.split("/")]
    e, h, i = args.experts, args.hidden, args.inter
    stacks = [_random_experts(types[0], e, i, h), _random_experts(types[1], e, i, h),
              _random_experts(types[2], e, h, i)]
    assert expert_batch.supports(*stacks), f"{mix}: not a planes mix"
    moe = _moe(h, i, e, args.top_k, stacks)

    def row_by_row(x):
        return torch.cat([experts_triton(moe, x[b : b + 1]) for b in range(x.shape[0])])

    def batched(x):
        return experts_rows(moe, x) if x.shape[0] > 1 else experts_triton(moe, x)

    def batched_one(x):  # B = 1 through the batched kernels too (a step never does this)
        weights, ids = router_topk_rows(x, moe.router.weight, moe.top_k, True)
        return expert_batch.routed_rows(x, *stacks, ids, weights)

    out = []
    for num_rows in num_rows_list:
        xs = [torch.randn(num_rows, h, device="cuda", dtype=torch.bfloat16)
              for _ in range(GRAPH_LAYERS)]
        with torch.inference_mode():
            read_bytes = _distinct_bytes(moe, xs, stacks)
            ref = row_by_row(xs[0]).float()
            diff = ((batched(xs[0]).float() - ref).abs().max()
                    / ref.abs().max().clamp_min(1e-30)).item()
            paths = [("row_by_row", row_by_row), ("batched", batched)]
            if num_rows == 1:
                paths.append(("batched_kernels_at_1", batched_one))
            for path, step in paths:
                us = _graph_us(step, xs)
                out.append({"experts": mix, "rows": num_rows, "path": path,
                            "us_per_layer": round(us, 2),
                            "distinct_expert_MB": round(read_bytes / 1e6, 2),
                            "expert_GBps": round(read_bytes / us / 1e3, 1),
                            "of_hbm": round(read_bytes / us * 1e6 / HBM_BYTES_PER_S, 3),
                            "max_rel_diff": float(f"{diff:.3g}")})
                print(out[-1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="Q4_K/Q4_K/Q6_K",
                        help="gate/up/down GGML types, comma-separated mixes")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    num_rows_list = [int(r) for r in args.rows.split(",")]
    rows = []
    for mix in args.mixes.split(","):
        rows += rows_for(mix, num_rows_list, args)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "shape": {"experts": args.experts, "hidden": args.hidden,
                                "inter": args.inter, "top_k": args.top_k},
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
