"""Bandwidth of the quantized decode kernels on the GPU (issue 19): one token (and 16) times a
Llama-3-8B-shaped weight in each GGML type, against cuBLAS on the same weight in bf16.

Prints one row per (type, shape, tokens) with microseconds, GB/s of blocks read and the
fraction of the HBM bandwidth given (--hbm-gb-s, 4300 for an H200), then the JSON. Each call
is timed twice: eagerly (Python launch included: a small matrix is bound by it) and replayed
from a CUDA graph of `GRAPH_CALLS` calls, as decode runs (`graph_*`: the kernel's own speed).

    python bench/diag_quant_gemv.py [--types Q4_K,Q6_K,Q8_0,Q4_1] [--shapes qkv,v,head]
                                    [--tokens 1] [--hbm-gb-s 4300]

`kernel` in each row: quant/kernels.decode_kernel's pick (planes or tile); one token of Q4_K,
Q6_K or Q8_0 is timed twice, by gemv_dp4a.py's kernel ("dp4a", what decode takes) and by
the planes kernel (STRATA_DP4A=0), with the largest difference between the two relative to
the output's scale. A last table puts the two side by side: graph fraction of HBM each, and
dp4a's speed-up. Llama-3-8B Q4_K_M keeps v, half the downs and the head in Q6_K.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from limits import time_s  # bench/limits.py, next to this file

SHAPES = {"qkv [6144, 4096]": (6144, 4096), "o [4096, 4096]": (4096, 4096),
          "gate_up [28672, 4096]": (28672, 4096), "down [4096, 14336]": (4096, 14336),
          "v [1024, 4096]": (1024, 4096), "head [128256, 4096]": (128256, 4096)}


GRAPH_CALLS = 20


def _time_us(fn, repeats: int = 50) -> float:
    return time_s(fn, repeats) * 1e6  # limits.py: CUDA events after one warm-up


def _graph_time_us(fn) -> float:
    """Microseconds per call of fn replayed from one CUDA graph of GRAPH_CALLS calls (fn has
    run before, so no compile or autotuning is captured)."""
    from strata.engine.core.fast.side_stream import side_stream

    with side_stream():
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    return _time_us(graph.replay, 10) / GRAPH_CALLS


def _row(args, type_name: str, label: str, tokens: int, kernel: str, x, weight, dense,
         num_bytes: int) -> dict:
    from strata.engine.core.quant import gemv_dp4a, kernels
    from strata.engine.core.quant.weight import qlinear

    quant_us = _time_us(lambda: qlinear(x, weight))
    dense_us = _time_us(lambda: torch.nn.functional.linear(x, dense))
    gb_s = num_bytes / quant_us / 1e3
    graph_us = _graph_time_us(lambda: qlinear(x, weight))
    dense_graph_us = _graph_time_us(lambda: torch.nn.functional.linear(x, dense))
    graph_gb_s = num_bytes / graph_us / 1e3
    if kernel == "dp4a":
        tuner = gemv_dp4a._tuned[int(weight.qtype)]
    else:
        path = {"planes": "_planes_tuned", "tile": "_matmul_tuned"}[kernel]
        tuner = getattr(kernels, path)["sum" if tokens == 1 else "dot"]
    return {"type": type_name, "weight": label, "tokens": tokens, "kernel": kernel,
            "quant_us": round(quant_us, 2), "bf16_cublas_us": round(dense_us, 2),
            "blocks_gb_s": round(gb_s, 1), "fraction_of_hbm": round(gb_s / args.hbm_gb_s, 3),
            "graph_us": round(graph_us, 2), "bf16_cublas_graph_us": round(dense_graph_us, 2),
            "graph_blocks_gb_s": round(graph_gb_s, 1),
            "graph_fraction_of_hbm": round(graph_gb_s / args.hbm_gb_s, 3),
            "config": str(getattr(tuner, "best_config", ""))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_1,Q4_0,Q5_K")
    parser.add_argument("--shapes", default=",".join(label.split()[0] for label in SHAPES),
                        help="weights by name: " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default="1,16", help="token counts, e.g. 1")
    parser.add_argument("--hbm-gb-s", type=float, default=4300.0)
    args = parser.parse_args()
    from strata.engine.core.quant import gemv_dp4a, kernels
    from strata.engine.core.quant.weight import QuantizedWeight, qlinear

    rows = []
    for type_name in args.types.split(","):
        qtype = GGMLQuantizationType[type_name]
        block_size, block_bytes = GGML_QUANT_SIZES[qtype]
        for label, (n, k) in SHAPES.items():
            if label.split()[0] not in args.shapes.split(","):
                continue
            raw = torch.randint(0, 256, (n, k // block_size * block_bytes), dtype=torch.uint8,
                                device="cuda")
            # Finite fp16 fields: small random bytes everywhere keep every scale finite.
            raw &= 0x3F
            weight = QuantizedWeight(qtype, (n, k), raw, torch.bfloat16)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for tokens in (int(t) for t in args.tokens.split(",")):
                x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
                variants = [(kernels.decode_kernel(qtype), None)]
                if gemv_dp4a.is_enabled(x, qtype):  # both kernels, and how far apart
                    variants.insert(0, ("dp4a", "1"))
                    variants[1] = (variants[1][0], "0")
                outputs = {}
                for kernel, switch in variants:
                    if switch is not None:
                        os.environ["STRATA_DP4A"] = switch
                    outputs[kernel] = qlinear(x, weight).float()
                    rows.append(_row(args, type_name, label, tokens, kernel, x, weight, dense,
                                     raw.numel()))
                    print(rows[-1])
                os.environ.pop("STRATA_DP4A", None)
                if "dp4a" in outputs:
                    planes = outputs["planes"]
                    rows[-2]["rel_diff_vs_planes"] = float(
                        f"{((outputs['dp4a'] - planes).abs().max() / planes.abs().max()).item():.3g}")
                    print({"dp4a_rel_diff_vs_planes": rows[-2]["rel_diff_vs_planes"]})
    _print_gains(rows)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}))


def _print_gains(rows: list[dict]) -> None:
    """One line per weight timed both ways: graph fraction of HBM, dp4a over planes."""
    planes = {(r["type"], r["weight"]): r for r in rows if r["kernel"] == "planes"
              and r["tokens"] == 1}
    print(f"{'type':6} {'weight':24} {'dp4a':>6} {'planes':>6} {'gain':>6}  (graph fraction "
          "of HBM, one token)")
    for r in rows:
        other = planes.get((r["type"], r["weight"]))
        if r["kernel"] == "dp4a" and other:
            print(f"{r['type']:6} {r['weight']:24} {r['graph_fraction_of_hbm']:6.3f} "
                  f"{other['graph_fraction_of_hbm']:6.3f} "
                  f"{other['graph_us'] / r['graph_us']:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
