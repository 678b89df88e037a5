"""Time of one Qwen3-30B-A3B-shaped MoE layer over quantized experts on the GPU (issue 19),
against the same layer over bf16 experts: one token (router, routed experts dequantized by
the gather kernel, grouped kernels) and a prefill chunk (each projection of all experts
dequantized into the scratch, grouped GEMMs), per GGML type.

Prints one row per (type, tokens) with microseconds and the bytes of blocks the step must
read, then the JSON. One token of a planes type (gemv_planes.ALL_PLANE_LANES) takes the fused
kernels (expert_gemv.py), the others dequantize into a scratch first (expert_kernels.py).
Then, per planes type, "graph" rows: one token's routed experts replayed from a CUDA graph,
the fused kernels against the dequantize_routed + grouped kernels they replace, over
GRAPH_LAYERS tokens routed to different experts (their blocks exceed the L2, as a decode
step's 48 layers do), microseconds per layer, the k experts' bytes per second and their
fraction of HBM (--hbm-gb-s). For Q4_K, Q6_K and Q8_0 the fused kernels run twice: by dp4a
("fused dp4a": x and the activations in int8, four launches) and by planes ("fused planes",
STRATA_DP4A=0); the last table puts them side by side. A type GATE/DOWN (Q4_K/Q6_K: the
Q4_K_M layers with Q6_K down projections) gives gate/up and down different types.

    python bench/diag_quant_experts.py [--types Q4_K,Q6_K,Q8_0,Q4_K/Q6_K,IQ2_XXS]
                                       [--experts 128] [--graph-only]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from limits import time_s  # bench/limits.py, next to this file


def _time_us(fn, repeats: int) -> float:
    return time_s(fn, repeats) * 1e6  # limits.py: CUDA events after one warm-up


def _random_experts(qtype, num_experts: int, rows: int, cols: int):
    from strata.engine.core.quant.experts import QuantizedExperts

    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (num_experts, rows, cols // block_size * block_bytes),
                           dtype=torch.uint8, device="cuda")
    blocks &= 0x3F  # small bytes everywhere: every fp16 scale finite (diag_quant_gemv.py)
    return QuantizedExperts(qtype, (num_experts, rows, cols), blocks, torch.bfloat16)


GRAPH_LAYERS = 16  # tokens per graph replay, each routed to other experts


def _graph_us(step, xs, repeats: int = 20) -> float:
    """Microseconds per step(x) replayed from one CUDA graph over every x in xs."""
    from strata.engine.core.fast.side_stream import side_stream

    with side_stream():  # compile and autotune outside the capture
        for x in xs[:2]:
            step(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            step(x)
    return _time_us(graph.replay, repeats) / len(xs)


def graph_rows(moe, stacks, type_name: str, top_k: int, hbm_gb_s: float) -> list[dict]:
    """The fused kernels (dp4a and planes where both apply) against dequantize_routed + the
    grouped kernels, from CUDA graphs."""
    from strata.engine.core.fast import moe_triton
    from strata.engine.core.quant import expert_gemv
    from strata.engine.core.quant.expert_kernels import dequantize_routed

    gate, up, down = stacks
    router = moe.router.weight

    def fused(x):
        weights, ids = moe_triton.router_topk(x, router, top_k, True)
        return expert_gemv.routed_mlp(x, gate, up, down, ids, weights)

    def dequantized(x):
        weights, ids = moe_triton.router_topk(x, router, top_k, True)
        g, u, d, local = dequantize_routed(gate, up, down, ids)
        act = moe_triton.grouped_gate_up(x, g, u, local)
        return moe_triton.grouped_down_sum(act, d, local, weights)

    xs = [torch.randn(router.shape[1], device="cuda", dtype=torch.bfloat16)
          for _ in range(GRAPH_LAYERS)]
    reference = dequantized(xs[0]).float()
    read_bytes = sum(s.nbytes for s in stacks) * top_k // gate.num_experts
    has_dp4a = any(expert_gemv.uses_dp4a(w, xs[0]) for w in stacks)
    paths = [("fused dp4a", fused, "1"), ("fused planes", fused, "0")] if has_dp4a else [
        ("fused", fused, None)]
    paths.append(("dequantize_routed+grouped", dequantized, None))
    rows = []
    for path, step, switch in paths:
        if switch is not None:
            os.environ["STRATA_DP4A"] = switch
        # Relative to the output's scale: random blocks give outputs of any magnitude.
        error = ((step(xs[0]).float() - reference).abs().max()
                 / reference.abs().max().clamp_min(1e-30)).item()
        us = _graph_us(step, xs)
        os.environ.pop("STRATA_DP4A", None)
        gb_s = read_bytes / us / 1e3
        rows.append({"experts": type_name, "graph": path, "us_per_layer": round(us, 2),
                     "expert_GBps": round(gb_s, 1), "fraction_of_hbm": round(gb_s / hbm_gb_s, 3),
                     "max_rel_diff": float(f"{error:.3g}")})
        print(rows[-1])
    return rows


def _print_gains(graphs: list[dict]) -> None:
    """dp4a against planes per type: us per layer, fraction of HBM, speed-up."""
    by = {(r["experts"], r["graph"]): r for r in graphs}
    print(f"{'experts':10} {'dp4a us':>8} {'planes us':>9} {'dp4a':>6} {'planes':>6} {'gain':>6}"
          "  (one layer from CUDA graphs; fractions of HBM)")
    for (name, path), r in by.items():
        other = by.get((name, "fused planes"))
        if path == "fused dp4a" and other:
            print(f"{name:10} {r['us_per_layer']:8.2f} {other['us_per_layer']:9.2f} "
                  f"{r['fraction_of_hbm']:6.3f} {other['fraction_of_hbm']:6.3f} "
                  f"{other['us_per_layer'] / r['us_per_layer']:5.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ2_XXS,IQ3_S")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--hbm-gb-s", type=float, default=4300.0)
    parser.add_argument("--graph-only", action="store_true",
                        help="only the CUDA-graph rows of the fused kernels (no prefill)")
    args = parser.parse_args()
    from strata.engine.core.fast.moe_grouped import experts_triton
    from strata.engine.core.fast.moe_prefill import moe_block
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant.gemv_planes import ALL_PLANE_LANES
    from strata.engine.core.quant.weight import reserve_scratch

    e, h, i = args.experts, args.hidden, args.inter
    moe = SparseMoE(h, i, e, args.top_k, True).cuda().bfloat16()
    reserve_scratch(torch.device("cuda"), torch.bfloat16, e * h * i)
    float_stacks = (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    rows, graphs = [], []

    def measure(label: str, read_bytes: int) -> None:
        for tokens in (1, args.prefill_tokens):
            x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
            step = (lambda x=x: experts_triton(moe, x)) if tokens == 1 else (
                lambda x=x: moe_block(moe, x))
            us = _time_us(step, repeats=20 if tokens > 1 else 100)
            rows.append({"experts": label, "tokens": tokens, "us": round(us, 2),
                         "expert_bytes_read": read_bytes if tokens == 1 else read_bytes * e
                         // args.top_k})
            print(rows[-1])

    if not args.graph_only:
        measure("bf16", 3 * args.top_k * h * i * 2)
    for type_name in args.types.split(","):
        gate_type, _, down_type = type_name.partition("/")
        qtype = GGMLQuantizationType[gate_type]
        down_qtype = GGMLQuantizationType[down_type or gate_type]
        stacks = [_random_experts(qtype, e, i, h), _random_experts(qtype, e, i, h),
                  _random_experts(down_qtype, e, h, i)]
        for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
            del moe.experts._parameters[name]
            setattr(moe.experts, name, stack)
        if not args.graph_only:
            measure(type_name, sum(s.nbytes for s in stacks) * args.top_k // e)
        if int(qtype) in ALL_PLANE_LANES and int(down_qtype) in ALL_PLANE_LANES:
            graphs += graph_rows(moe, stacks, type_name, args.top_k, args.hbm_gb_s)
        for name, param in zip(("gate_proj", "up_proj", "down_proj"), float_stacks):
            delattr(moe.experts, name)
            moe.experts.register_parameter(name, param)
    _print_gains(graphs)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "shape": {"experts": e, "hidden": h, "inter": i, "top_k": args.top_k},
                      "rows": rows, "graph_rows": graphs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
