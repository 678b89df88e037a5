"""The dequantizer and the quantized MoE prefill's two paths on the GPU (issue 19).

(a) `dequant`: GB/s (blocks read + bf16 written) of quant/dequant.py's autotuned kernel
against the old per-value tile (dequant_tile.py at 16 x 256, what prefill ran before) per
GGML type, at Llama-3-8B's matrices and Qwen3-30B-A3B's expert stacks as the model stores
them (128 x gate [768, 2048], the same for up, 128 x down [2048, 768]), as a fraction of
the HBM bandwidth a large device copy measures here. Their outputs must be equal.
(b) `moe`: one Qwen3-30B-A3B-shaped MoE layer's prefill (moe_prefill.moe_block: router,
sort, experts, sum) per token count, through expert_gemm.py and through expert_grouped.py
(dequantize 16 experts at a time, torch._grouped_mm), called and replayed from a CUDA graph
(fast/expert_graphs.py, as called prefills run it), forced by the crossover constants;
the crossover to set is the first rows-per-expert where the replayed path wins. With
--profile, each path's kernels at each token count by torch.profiler (profile_decode's
table): which launches the time goes to. With --scratch-mib, the replayed path again per
expert scratch size (expert_grouped.EXPERT_SCRATCH_BYTES, which sets the experts a group):
whether smaller groups, whose dequantized weights might stay in L2, or larger ones, with
fewer launches, are faster.

Random valid blocks (bench/gguf_pools.py's pools, repeated). Median times of
triton.testing.do_bench. Prints tables, writes JSON to --out.

    python bench/diag_dequant.py [--part dequant|moe|both] [--types Q4_K,Q6_K,...]
        [--tokens 128,256,512,1024,2048,4096] [--profile] [--scratch-mib 24,48,96,192]
        [--out diag-dequant.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gguf_pools.py, limits.py

# (name, experts or 0 for a matrix, rows, cols)
SHAPES = (("8b.qkv", 0, 6144, 4096), ("8b.o", 0, 4096, 4096), ("8b.gate_up", 0, 28672, 4096),
          ("8b.down", 0, 4096, 14336), ("30b.gate", 128, 768, 2048), ("30b.up", 128, 768, 2048),
          ("30b.down", 128, 2048, 768))
OLD_TILE = ("tile", (16, 256, 4))  # the dequantizer before dequant.py: 16 x 256, 4 warps
MOE_SHAPE = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8}
DEVICE = "cuda"  # a smoke test of the logic may set "cpu" (Triton interpreter)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("dequant", "moe", "both"), default="both")
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_K,Q4_0,IQ2_XXS",
                        help="GGML types of part (a)")
    parser.add_argument("--moe-types", default="Q4_K,Q4_K,Q6_K",
                        help="gate,up,down types of part (b) (Q4_K_M's)")
    parser.add_argument("--tokens", default="128,256,512,1024,2048,4096")
    parser.add_argument("--profile", action="store_true",
                        help="part (b): per-kernel CUDA time of each path (torch.profiler)")
    parser.add_argument("--scratch-mib", default="",
                        help="part (b): the replayed path again at these expert scratch sizes")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    from gguf import GGMLQuantizationType

    args.types = [GGMLQuantizationType[t] for t in args.types.split(",")]
    args.moe_types = [GGMLQuantizationType[t] for t in args.moe_types.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.scratch_mib = [int(m) for m in args.scratch_mib.split(",") if m]
    if len(args.moe_types) != 3 or min(args.tokens) < 1 or min(args.scratch_mib, default=1) < 1:
        parser.error("--moe-types takes gate,up,down; --tokens and --scratch-mib positive counts")
    return args


def _blocks(qtype, rows: int, cols: int, seed: int = 0):
    """uint8 [rows, row_bytes] on CUDA: a pool of valid blocks repeated."""
    import torch
    from gguf_pools import byte_pool, row_bytes

    pool = torch.from_numpy(byte_pool(qtype, seed)).to(DEVICE)
    size = rows * row_bytes(qtype, cols)
    return pool.repeat(-(-size // pool.numel()))[:size].view(rows, -1)


def _ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _runner(qtype, experts: int, n: int, k: int):
    """(run(fixed=None) -> out, bytes the run moves): the matrix or expert stack's
    dequantization into a bf16 buffer, by the tuned kernel or a fixed tile."""
    import torch

    from strata.engine.core.quant import dequant
    from strata.engine.core.quant.experts import QuantizedExperts

    blocks = _blocks(qtype, max(experts, 1) * n, k)
    out = torch.empty(max(experts, 1) * n, k, dtype=torch.bfloat16, device=DEVICE)
    moved = blocks.numel() + out.numel() * out.element_size()
    if not experts:
        return (lambda fixed=None: dequant.dequantize(blocks, qtype, k, torch.bfloat16, out,
                                                      fixed=fixed)), moved
    stack = QuantizedExperts(qtype, (experts, n, k), blocks.view(experts, n, -1),
                             torch.bfloat16)
    out3 = out.view(experts, n, k)
    return (lambda fixed=None: dequant.dequantize_experts(stack, 0, out3, fixed=fixed)), moved


def dequant_rows(types, hbm_gb_s: float) -> list[dict]:
    import torch

    from strata.engine.core.quant import dequant

    rows = []
    print(f"{'type':8} {'shape':11} {'kernel':6} {'old GB/s':>8} {'new GB/s':>8} "
          f"{'old/HBM':>7} {'new/HBM':>7} {'speedup':>7}")
    for qtype in types:
        kernel = "planes" if int(qtype) in dequant.gp.ALL_PLANE_LANES else "tile"
        for name, experts, n, k in SHAPES:
            run, moved = _runner(qtype, experts, n, k)
            new = run().clone()
            new_ms = _ms(run)
            old_ms = _ms(lambda run=run: run(OLD_TILE))
            same = torch.equal(run(OLD_TILE), new)
            old_gb_s, new_gb_s = moved / old_ms / 1e6, moved / new_ms / 1e6
            row = {"type": qtype.name, "shape": name, "experts": experts, "rows": n, "cols": k,
                   "kernel": kernel, "bytes": moved,
                   "old_us": round(old_ms * 1e3, 1), "new_us": round(new_ms * 1e3, 1),
                   "old_gb_s": round(old_gb_s), "new_gb_s": round(new_gb_s),
                   "old_of_hbm": round(old_gb_s / hbm_gb_s, 3),
                   "new_of_hbm": round(new_gb_s / hbm_gb_s, 3), "equal": same}
            rows.append(row)
            print(f"{qtype.name:8} {name:11} {kernel:6} {old_gb_s:8.0f} {new_gb_s:8.0f} "
                  f"{row['old_of_hbm']:7.3f} {row['new_of_hbm']:7.3f} {old_ms / new_ms:7.2f}"
                  f"{'' if same else '  OUTPUTS DIFFER'}", flush=True)
    return rows


def _profile(title: str, run, calls: int = 5) -> None:
    """Per-kernel CUDA time of `calls` runs, per run (profile_decode's table)."""
    import torch
    from profile_decode import kernel_table, print_table
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started_s = time.perf_counter()
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started_s
    print_table(title, kernel_table(prof), calls, wall_s, top=10)
    # The host's share: how long the call takes to return without waiting for the GPU (a
    # launch-bound path returns late), and the synchronizing calls torch reports in it.
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    run()
    host_s = time.perf_counter() - started_s
    torch.cuda.synchronize()
    total_s = time.perf_counter() - started_s
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in caught
             if "synchroniz" in str(w.message)]
    print(f"  host returns after {host_s * 1e6:.0f} us of {total_s * 1e6:.0f} us; "
          f"{len(syncs)} synchronizing calls{': ' + ', '.join(sorted(set(syncs))) if syncs else ''}")


def _moe_layer(types):
    """A Qwen3-30B-A3B-shaped SparseMoE on the GPU whose experts hold random blocks of
    types (gate, up, down), and those three QuantizedExperts."""
    import torch

    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant.experts import QuantizedExperts

    e, h, i, k = (MOE_SHAPE[key] for key in ("experts", "hidden", "inter", "top_k"))
    moe = SparseMoE(h, i, e, k, True).to(DEVICE).bfloat16()
    stacks = [QuantizedExperts(q, (e, n, c), _blocks(q, e * n, c, seed=p).view(e, n, -1),
                               torch.bfloat16)
              for p, (q, (n, c)) in enumerate(zip(types, ((i, h), (i, h), (h, i))))]
    for name, stack in zip(("gate_proj", "up_proj", "down_proj"), stacks):
        del moe.experts._parameters[name]
        setattr(moe.experts, name, stack)
    return moe, stacks


def moe_rows(types, token_counts, profiled: bool = False) -> list[dict]:
    import torch

    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.fast.expert_graphs import ExpertGraphs
    from strata.engine.core.fast.pointwise import PointwiseOps
    from strata.engine.core.quant import expert_grouped
    from strata.engine.core.quant.weight import reserve_scratch

    e, h, k = (MOE_SHAPE[key] for key in ("experts", "hidden", "top_k"))
    moe, stacks = _moe_layer(types)
    print(f"grouped path: {expert_grouped.experts_per_group(*stacks)} experts a group")
    reserve_scratch(torch.device(DEVICE), torch.bfloat16, expert_grouped.scratch_numel(*stacks))
    moe_prefill.warm_up_quantized(moe)  # compiles and autotunes both paths, as the load does
    graphs = ExpertGraphs(torch.device(DEVICE), max(token_counts), k)
    replaying = PointwiseOps(grouped_experts=graphs.experts_mlp)
    saved = expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT, expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT
    rows = []
    # gemm: expert_gemm called; grouped: expert_grouped called; replayed: expert_grouped
    # replayed per layer from a CUDA graph (expert_graphs.py), the inputs' copies included.
    paths = (("gemm", 1 << 30, PointwiseOps()), ("grouped", 0, PointwiseOps()),
             ("replayed", 0, replaying))
    print(f"{'tokens':>6} {'rows/exp':>8} {'gemm_us':>9} {'grouped_us':>10} "
          f"{'replayed_us':>11} {'gemm/repl':>9} {'chosen':>8}  max_diff")
    try:
        for tokens in token_counts:
            x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
            times, outs = {}, {}
            for path, threshold, ops in paths:
                expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = threshold
                expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT = threshold
                for _ in range(2):  # a replayed path warms up, then captures
                    outs[path] = moe_prefill.moe_block(moe, x, ops).clone()
                times[path] = _ms(lambda x=x, ops=ops: moe_prefill.moe_block(moe, x, ops)) * 1e3
                if profiled:
                    _profile(f"{path}, {tokens} tokens",
                             lambda x=x, ops=ops: moe_prefill.moe_block(moe, x, ops))
            expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = saved[0]
            expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT = saved[1]
            chosen = ("replayed" if tokens * k >= expert_grouped.min_rows(e, replayed=True)
                      else "gemm")
            scale = outs["gemm"].float().abs().max().item()
            diff = max((outs["gemm"].float() - outs[p].float()).abs().max().item()
                       for p in ("grouped", "replayed"))
            row = {"tokens": tokens, "rows_per_expert": tokens * k / e,
                   "gemm_us": round(times["gemm"], 1), "grouped_us": round(times["grouped"], 1),
                   "replayed_us": round(times["replayed"], 1), "chosen": chosen,
                   "rel_diff": round(diff / max(scale, 1e-30), 5),
                   "replay_equals_called": bool(torch.equal(outs["grouped"], outs["replayed"]))}
            rows.append(row)
            print(f"{tokens:6d} {tokens * k / e:8.1f} {times['gemm']:9.1f} "
                  f"{times['grouped']:10.1f} {times['replayed']:11.1f} "
                  f"{times['gemm'] / times['replayed']:9.2f} {chosen:>8}  {diff:.3g} "
                  f"(of {scale:.3g}); replay == called: {row['replay_equals_called']}",
                  flush=True)
    finally:
        expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = saved[0]
        expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT = saved[1]
    wins = [r["rows_per_expert"] for r in rows if r["replayed_us"] < r["gemm_us"]]
    print(f"replayed grouped path faster from {min(wins) if wins else '-'} rows per expert "
          f"(REPLAYED_MIN_ROWS_PER_EXPERT = {saved[1]}); {len(graphs)} graphs")
    return rows


def group_rows(types, token_counts, scratch_mibs: list[int]) -> list[dict]:
    """The replayed grouped path per expert scratch size: its time and how far its output is
    from the default size's (per expert the same products, so it should be equal or nearly)."""
    import torch

    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.fast.expert_graphs import ExpertGraphs
    from strata.engine.core.fast.pointwise import PointwiseOps
    from strata.engine.core.quant import expert_grouped

    moe, stacks = _moe_layer(types)
    moe_prefill.warm_up_quantized(moe)
    saved = (expert_grouped.EXPERT_SCRATCH_BYTES, expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT,
             expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT)
    xs = {t: torch.randn(t, MOE_SHAPE["hidden"], device=DEVICE, dtype=torch.bfloat16)
          for t in token_counts}
    rows, reference = [], {}
    print(f"{'scratch_mib':>11} {'group':>5} {'tokens':>6} {'replayed_us':>11}  max_diff")
    try:
        expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT = 0
        expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT = 0
        for mib in [saved[0] >> 20, *scratch_mibs]:  # the default first: the reference
            expert_grouped.EXPERT_SCRATCH_BYTES = mib << 20
            group = expert_grouped.experts_per_group(*stacks)
            ops = PointwiseOps(grouped_experts=ExpertGraphs(
                torch.device(DEVICE), max(token_counts), MOE_SHAPE["top_k"]).experts_mlp)
            for tokens, x in xs.items():
                for _ in range(2):  # warm up, then capture
                    out = moe_prefill.moe_block(moe, x, ops).clone()
                us = _ms(lambda x=x, ops=ops: moe_prefill.moe_block(moe, x, ops)) * 1e3
                reference.setdefault(tokens, out)
                diff = (out.float() - reference[tokens].float()).abs().max().item()
                rows.append({"scratch_mib": mib, "experts_a_group": group, "tokens": tokens,
                             "replayed_us": round(us, 1), "max_diff": diff})
                print(f"{mib:11d} {group:5d} {tokens:6d} {us:11.1f}  {diff:.3g}", flush=True)
    finally:
        (expert_grouped.EXPERT_SCRATCH_BYTES, expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT,
         expert_grouped.REPLAYED_MIN_ROWS_PER_EXPERT) = saved
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import triton
    from limits import hbm_bandwidth_gb_s

    started_s = time.perf_counter()
    result = {"figure": "dequant_and_moe_prefill", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__}
    if args.part in ("dequant", "both"):
        hbm = hbm_bandwidth_gb_s(torch.device(DEVICE))
        print(f"HBM (device copy, read + write): {hbm:.0f} GB/s")
        result.update(hbm_gb_s=round(hbm), dequant=dequant_rows(args.types, hbm))
    if args.part in ("moe", "both"):
        result.update(moe_shape=MOE_SHAPE, moe_types=[t.name for t in args.moe_types],
                      moe=moe_rows(args.moe_types, args.tokens, args.profile))
        if args.scratch_mib:
            result["groups"] = group_rows(args.moe_types, args.tokens, args.scratch_mib)
    result["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    text = json.dumps(result)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
