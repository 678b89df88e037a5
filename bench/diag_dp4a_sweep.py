"""Every dp4a GEMV tile in a grid, not only the autotuner's candidates (gemv_dp4a.CONFIGS):
does any read a Llama-3-8B weight nearer the HBM bandwidth than the autotuner's pick?

Run 24d's profile had the 8B Q4_K_M's dp4a GEMVs at 78% of a decode token, reading at about
0.55 of HBM. If some tile reads far nearer the limit, the candidates are the fix; if none
does, the kernel's structure is (bytes in flight per SM), and a new kernel is the work.

    python bench/diag_dp4a_sweep.py [--types Q4_K,Q6_K] [--shapes qkv,o,gate_up,down,head]
                                    [--grid candidates|small|full] [--hbm-gb-s 4300]
                                    [--cold-mib 256]
                                    [--out F.json]

Each config is timed replayed from a CUDA graph (diag_quant_gemv's timing: the kernel's own
speed, x's int8 rounding included for all alike), and its product is compared with the
tuned kernel's: the same integer sums, summed in another order, so within the rounding of
the bf16 output.
The graph's calls take turns over copies of the weight, at least `--cold-mib` of them (256
by default, four times the H200's 60 MB L2): a decode reads each layer's weight once a
token, from HBM, and a weight smaller than L2 replayed alone would be read from L2 (run 26's
first sweeps did that for qkv, o and down; `--cold-mib 0` times that way again).
`--grid small` compiles 40-60 tiles a type (a few minutes on the H200); `full` 140-200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "v": (1024, 4096), "head": (128256, 4096)}
GRIDS = {  # (BLOCK_ROWS, BLOCK_COLS, num_warps, STAGES) values to combine
    "candidates": ((), (), (), ()),  # gemv_dp4a.CONFIGS' tiles only
    "small": ((2, 4, 8, 16), (2048, 4096, 8192), (2, 4, 8), (1, 3)),
    "full": ((1, 2, 4, 8, 16, 32), (1024, 2048, 4096, 8192), (1, 2, 4, 8), (1, 2, 3)),
}
MAX_GROUPS_A_THREAD = 16  # more holds too many registers to be worth compiling
# The same integer sums in another order, rounded to x's bf16: a value moves by one bf16 ulp
# at most, 2^-8 of the output's scale where it is largest (run 26 measured up to 0.0018 of
# it); two ulps is the bound, a wrong tile is off by far more.
MAX_REL_DIFF = 2.0 ** -7


def tiles(qtype: int, grid: str) -> list[tuple[int, int, int, int]]:
    """The autotuner's candidates, and the grid's tiles a thread can take whole groups of
    (gemv_dp4a.CONFIGS' rule): at least one group a thread, at most MAX_GROUPS_A_THREAD."""
    from strata.engine.core.quant.dp4a_dots import GROUP_VALUES
    from strata.engine.core.quant.gemv_dp4a import CONFIGS

    group = GROUP_VALUES[qtype]
    out = set(CONFIGS[qtype])
    for rows, cols, warps, stages in itertools.product(*GRIDS[grid]):
        groups = rows * cols // group
        if cols >= group and 32 * warps <= groups <= MAX_GROUPS_A_THREAD * 32 * warps:
            out.add((rows, cols, warps, stages))
    return sorted(out)


def run_tile(x: torch.Tensor, raw: torch.Tensor, qtype: int, num_rows: int,
             tile: tuple[int, int, int, int]) -> torch.Tensor:
    """x [1, K] @ W^T by gemv_dp4a's kernel at one tile, launched directly (the autotuner
    would pick its own); [1, num_rows] in x's dtype."""
    import triton

    from strata.engine.core.kernels import pdl
    from strata.engine.core.quant import gemv_dp4a

    rows, cols, warps, stages = tile
    out = torch.empty(1, num_rows, dtype=x.dtype, device=x.device)
    args, kwargs = gemv_dp4a.kernel_args(x, raw, qtype, num_rows, out)
    gemv_dp4a._dp4a_kernel[(triton.cdiv(num_rows, rows),)](
        *args, **kwargs, BLOCK_ROWS=rows, BLOCK_COLS=cols, STAGES=stages, num_warps=warps,
        **pdl.launch_options(False))
    return out


def random_weight(qtype: int, num_rows: int, num_cols: int, device: str) -> torch.Tensor:
    """Random blocks whose fp16 fields stay small and finite (diag_quant_gemv's recipe)."""
    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    raw = torch.randint(0, 256, (num_rows, num_cols // block_size * block_bytes),
                        dtype=torch.uint8, device=device)
    return raw & 0x3F


def cold_copies(raw: torch.Tensor, cold_bytes: int) -> list[torch.Tensor]:
    """raw and enough copies of it that together they hold at least cold_bytes: calls that
    take turns over them read each from HBM, not from the L2 the last call filled."""
    count = max(1, -(-cold_bytes // raw.numel()))
    return [raw] + [raw.clone() for _ in range(count - 1)]


def taking_turns(call: Callable[[torch.Tensor], object],
                 weights: list[torch.Tensor]) -> Callable[[], object]:
    """call(weight) on the next of weights at each call: a graph captures each call with
    the copy it took, so a replay reads them in turn."""
    turn = itertools.cycle(weights)
    return lambda: call(next(turn))


def sweep(qtype: int, shape: tuple[int, int], candidates: list[tuple[int, int, int, int]],
          time_us: Callable[[Callable[[], object]], float], device: str,
          cold_bytes: int = 0) -> list[dict]:
    """One row a tile: microseconds a call (calls taking turns over copies of the weight
    that hold cold_bytes together), blocks' GB/s and the largest difference from the tuned
    kernel's product relative to its scale; the tuned kernel's row first."""
    from strata.engine.core.quant import gemv_dp4a

    num_rows, num_cols = shape
    raw = random_weight(qtype, num_rows, num_cols, device)
    weights = cold_copies(raw, cold_bytes)
    x = torch.randn(1, num_cols, device=device, dtype=torch.bfloat16)
    tuned = gemv_dp4a.matmul(x, raw, qtype, num_rows).float()
    scale = tuned.abs().max().item() or 1.0
    tuner = gemv_dp4a._tuned[qtype]
    rows = [{"tile": "tuned " + str(getattr(tuner, "best_config", "")),
             "us": time_us(taking_turns(lambda w: gemv_dp4a.matmul(x, w, qtype, num_rows),
                                        weights)),
             "rel_diff": 0.0}]
    for tile in candidates:
        try:
            got = run_tile(x, raw, qtype, num_rows, tile).float()
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row too
            rows.append({"tile": str(tile), "us": None, "error": str(exc).splitlines()[0]})
            continue
        rows.append({"tile": str(tile),
                     "us": time_us(taking_turns(
                         lambda w, t=tile: run_tile(x, w, qtype, num_rows, t), weights)),
                     "rel_diff": (got - tuned).abs().max().item() / scale})
    for row in rows:
        if row["us"]:
            row["blocks_gb_s"] = raw.numel() / row["us"] / 1e3
    return rows


def graph_time_us(fn: Callable[[], object]) -> float:
    from diag_quant_gemv import _graph_time_us  # bench/, next to this file

    return _graph_time_us(fn)


def wall_time_us(fn: Callable[[], object]) -> float:
    """Wall-clock microseconds of one call (the CPU interpreter: no graphs, no events)."""
    fn()
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K",
                        help="GGML types the dp4a kernel takes (quant/dp4a_dots.DP4A_TYPES)")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down,head",
                        help="8B weights: " + ", ".join(SHAPES))
    parser.add_argument("--grid", choices=sorted(GRIDS), default="small")
    parser.add_argument("--hbm-gb-s", type=float, default=4300.0)
    parser.add_argument("--cold-mib", type=int, default=256,
                        help="copies of each weight the timed calls take turns over hold at "
                             "least this much (0: one copy, replayed from L2 if it fits)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from strata.engine.core.quant.dp4a_dots import DP4A_TYPES

    try:
        args.types = [int(GGMLQuantizationType[name]) for name in args.types.split(",")]
    except KeyError as exc:
        parser.error(f"--types: no GGML type {exc}")
    if not set(args.types) <= DP4A_TYPES:
        names = sorted(GGMLQuantizationType(t).name for t in DP4A_TYPES)
        parser.error(f"--types: the dp4a kernel takes {', '.join(names)}")
    args.shapes = args.shapes.split(",")
    if not set(args.shapes) <= set(SHAPES):
        parser.error(f"--shapes: choose from {', '.join(SHAPES)}")
    if args.cold_mib < 0:
        parser.error("--cold-mib: 0 or more MiB")
    return args


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(), "hbm_gb_s": args.hbm_gb_s,
              "cold_mib": args.cold_mib, "rows": []}
    print(f"{'type':8} {'weight':8} {'tuned us':>9} {'best us':>8} {'best tile':24} "
          f"{'tuned HBM':>9} {'best HBM':>8}")
    for qtype in args.types:
        candidates = tiles(qtype, args.grid)
        for name in args.shapes:
            rows = sweep(qtype, SHAPES[name], candidates, graph_time_us, "cuda",
                         args.cold_mib << 20)
            report["rows"].append({"type": GGMLQuantizationType(qtype).name, "weight": name,
                                   "tiles": rows})
            timed = [r for r in rows[1:] if r["us"] and r["rel_diff"] < MAX_REL_DIFF]
            best = min(timed, key=lambda r: r["us"])
            print(f"{GGMLQuantizationType(qtype).name:8} {name:8} {rows[0]['us']:9.2f} "
                  f"{best['us']:8.2f} {best['tile']:24} "
                  f"{rows[0]['blocks_gb_s'] / args.hbm_gb_s:9.3f} "
                  f"{best['blocks_gb_s'] / args.hbm_gb_s:8.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
