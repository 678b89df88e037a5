"""Can torch's CPU kernels compute a missed MoE expert as fast as llama.cpp? (issue 54)

One Qwen3-30B-A3B expert (gate and up [768, 2048] Q4_K, down [2048, 768] Q6_K or Q4_K, as
Q4_K_M stores them) of random valid GGUF blocks (std 0.02, bench/gguf_pools.py's scale),
its SwiGLU FFN on the CPU for 1, 4 and 16 tokens, per thread count, through:
  int4: Q4_K converted exactly to int4 groups of 32 (cpu_expert_formats.py) for
        _weight_int4pack_mm_for_cpu, gate and up fused into one [1536, 2048] matrix; a Q6_K
        (or Q8_0) down requantized to int8 per row for _weight_int8pack_mm, a Q4_K down int4;
  bf16: every matrix dequantized to bf16 once, F.linear.
Activations and scales are bf16 (torch's fast CPU path; float32 or fp16 run 25-30x slower).
Reports us per expert, GB/s of the format's weight bytes and of the GGUF bytes the same
expert holds, against llama.cpp's ~57 us an expert on run 36's 16-core host
(docs/benchmarks.md); the conversion's exactness (the kernel itself in float32 on sampled
input columns, then the bf16 scales' rounding), the int8 requantization's error, the FFN
output's error against float32 on the exact weights, conversion time and host bytes per
expert and per model (48 layers x 128 experts).

    python bench/diag_cpu_expert.py [--threads 1,2] [--tokens 1,4,16]
        [--down-types Q6_K,Q4_K] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for tests.helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # report.py, gguf_pools.py

import torch
import torch.nn.functional as F
from cpu_expert_formats import (
    INT4_GROUP,
    Int4Groups,
    dequantized,
    gguf_bytes,
    int4_bytes,
    int8_bytes,
    q4k_to_int4,
    to_int8_rows,
)
from gguf import GGMLQuantizationType as QT
from gguf_pools import weight_scale
from limits import best_cpu_s
from report import figure, format_figures, write_json

from tests.helpers.quant_blocks import random_blocks

LLAMACPP_US_PER_EXPERT = 57.0  # run 36's host, 16 threads (docs/benchmarks.md)
MODEL_EXPERTS = 48 * 128  # Qwen3-30B-A3B: layers x experts
DOWN_TYPES = (QT.Q6_K, QT.Q4_K, QT.Q8_0)
SAMPLED_COLUMNS = 64  # input columns the float32 kernel check runs (it is ~100x slower)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def counts(text: str) -> list[int]:
        values = [int(v) for v in text.split(",")]
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: want positive integers, e.g. 1,2")
        return values

    def down_types(text: str) -> list[QT]:
        names = {t.name: t for t in DOWN_TYPES}
        bad = [n for n in text.split(",") if n not in names]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad}: down types are {sorted(names)}")
        return [names[n] for n in text.split(",")]

    parser.add_argument("--threads", type=counts, default=[1, 2],
                        help="torch.set_num_threads values to sweep (1..16 on a device host)")
    parser.add_argument("--tokens", type=counts, default=[1, 4, 16])
    parser.add_argument("--down-types", type=down_types, default=[QT.Q6_K, QT.Q4_K])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768, help="an expert's intermediate size")
    parser.add_argument("--min-time-s", type=float, default=0.2, help="per timed round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="file to write the report to")
    args = parser.parse_args(argv)
    if args.hidden % 256 or args.inter % 256:
        parser.error("--hidden and --inter must be multiples of 256 (whole K-quant blocks)")
    return args


def random_matrix(qtype: QT, rows: int, cols: int, seed: int):
    """uint8 [rows, row_bytes] of random valid blocks whose values have std 0.02."""
    return random_blocks(qtype, rows, cols, seed, scale=weight_scale(qtype, seed))


def int4_operands(groups: Int4Groups):
    return groups.packed(torch.bfloat16)


def convention_error(groups: Int4Groups, exact: torch.Tensor, seed: int) -> float:
    """max |kernel's weight - exact| / max |exact| with float32 scales: the kernel run on unit
    rows of SAMPLED_COLUMNS input columns reads back those columns of the weight."""
    cols = exact.shape[1]
    picked = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    picked = picked[: min(SAMPLED_COLUMNS, cols)]
    packed, scales_and_zeros = groups.packed(torch.float32)
    unit_rows = torch.eye(cols)[picked]
    read = torch.ops.aten._weight_int4pack_mm_for_cpu(unit_rows, packed, INT4_GROUP,
                                                      scales_and_zeros)  # [S, rows]
    return float((read.t() - exact[:, picked]).abs().max() / exact.abs().max())


def bf16_scale_error(groups: Int4Groups, exact: torch.Tensor) -> float:
    """max |w - exact| / max |exact| once scale and zero are kept in bf16."""
    rounded = Int4Groups(groups.codes, groups.scales.bfloat16().float(),
                         groups.zeros.bfloat16().float())
    return float((rounded.dequantize() - exact).abs().max() / exact.abs().max())


class Expert:
    """One expert's GGUF blocks, their exact float32 values and both CPU forms."""

    def __init__(self, down_type: QT, hidden: int, inter: int, seed: int):
        self.down_type, self.hidden, self.inter = down_type, hidden, inter
        gate = random_matrix(QT.Q4_K, inter, hidden, seed)
        up = random_matrix(QT.Q4_K, inter, hidden, seed + 1)
        self.down_blocks = random_matrix(down_type, hidden, inter, seed + 2)
        self.gate_up_blocks = [gate, up]
        t0 = time.perf_counter()
        self.gate_up_groups = [q4k_to_int4(b, inter, hidden) for b in self.gate_up_blocks]
        fused = Int4Groups(*(torch.cat([getattr(g, f) for g in self.gate_up_groups])
                             for f in ("codes", "scales", "zeros")))
        self.gate_up_int4 = int4_operands(fused)
        self.down_int4 = self.down_int8 = None
        if down_type == QT.Q4_K:
            self.down_groups = q4k_to_int4(self.down_blocks, hidden, inter)
            self.down_int4 = int4_operands(self.down_groups)
        else:
            codes, scales = to_int8_rows(dequantized(self.down_blocks, down_type, hidden, inter))
            self.down_int8 = (codes, scales.bfloat16())
        self.convert_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.gate_up_exact = torch.cat([dequantized(b, QT.Q4_K, inter, hidden)
                                        for b in self.gate_up_blocks])
        self.down_exact = dequantized(self.down_blocks, down_type, hidden, inter)
        self.gate_up_bf16 = self.gate_up_exact.bfloat16()
        self.down_bf16 = self.down_exact.bfloat16()
        self.dequant_s = time.perf_counter() - t0

    def ffn_int(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.gate_up_int4[0], INT4_GROUP,
                                                             self.gate_up_int4[1])
        gate, up = gate_up.split(self.inter, dim=-1)
        h = F.silu(gate) * up  # [T, inter]
        if self.down_int4 is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.down_int4[0], INT4_GROUP,
                                                              self.down_int4[1])
        return torch.ops.aten._weight_int8pack_mm(h, *self.down_int8)

    def ffn_bf16(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_bf16).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_bf16)

    def ffn_exact(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x.float(), self.gate_up_exact).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_exact)

    def bytes_by_format(self) -> dict[str, int]:
        h, i = self.hidden, self.inter
        down_int = int4_bytes(h, i) if self.down_int4 is not None else int8_bytes(h, i)
        return {"gguf": 2 * gguf_bytes(QT.Q4_K, i, h) + gguf_bytes(self.down_type, h, i),
                "int4": 2 * int4_bytes(i, h) + down_int, "bf16": 2 * 3 * h * i}

    def errors(self, seed: int) -> dict[str, float]:
        out = {}
        for name, groups, blocks in (("gate", self.gate_up_groups[0], self.gate_up_blocks[0]),
                                     ("up", self.gate_up_groups[1], self.gate_up_blocks[1])):
            exact = dequantized(blocks, QT.Q4_K, self.inter, self.hidden)
            out[f"{name}_int4_kernel_f32"] = convention_error(groups, exact, seed)
            out[f"{name}_int4_bf16_scales"] = bf16_scale_error(groups, exact)
        if self.down_int4 is not None:
            out["down_int4_kernel_f32"] = convention_error(self.down_groups, self.down_exact, seed)
            out["down_int4_bf16_scales"] = bf16_scale_error(self.down_groups, self.down_exact)
        else:
            codes, scales = self.down_int8
            requant = codes.float() * scales.float()[:, None]
            diff = requant - self.down_exact
            out["down_int8_max"] = float(diff.abs().max() / self.down_exact.abs().max())
            out["down_int8_rms"] = float(diff.pow(2).mean().sqrt()
                                         / self.down_exact.pow(2).mean().sqrt())
        x = torch.randn(16, self.hidden, generator=torch.Generator().manual_seed(seed))
        x = x.bfloat16()
        reference = self.ffn_exact(x)
        scale = reference.abs().max()
        out["ffn_int4"] = float((self.ffn_int(x).float() - reference).abs().max() / scale)
        out["ffn_bf16"] = float((self.ffn_bf16(x).float() - reference).abs().max() / scale)
        return out


def run(args: argparse.Namespace) -> dict:
    """Build, check and time every down type; the report as a dict."""
    rows, figures, experts = [], [], {}
    for index, down_type in enumerate(args.down_types):
        expert = Expert(down_type, args.hidden, args.inter, args.seed + 10 * index)
        nbytes = expert.bytes_by_format()
        experts[down_type.name] = {
            "errors": expert.errors(args.seed), "bytes": nbytes,
            "model_gib": {k: v * MODEL_EXPERTS / 2**30 for k, v in nbytes.items()},
            "convert_int_ms": expert.convert_s * 1e3, "dequant_bf16_ms": expert.dequant_s * 1e3}
        for threads in args.threads:
            torch.set_num_threads(threads)
            for tokens in args.tokens:
                x = torch.randn(tokens, args.hidden).bfloat16()
                for path, fn in (("int4", expert.ffn_int), ("bf16", expert.ffn_bf16)):
                    us = best_cpu_s(lambda fn=fn, x=x: fn(x), args.min_time_s) * 1e6
                    row = {"down": down_type.name, "threads": threads, "tokens": tokens,
                           "path": path, "us": us, "format_gbps": nbytes[path] / us / 1e3,
                           "gguf_gbps": nbytes["gguf"] / us / 1e3}
                    rows.append(row)
                    figures.append(figure(
                        f"{down_type.name} {path} t{threads} x{tokens}", us, "us",
                        limit=LLAMACPP_US_PER_EXPERT, target=1.0, higher_is_better=False,
                        notes="limit: llama.cpp's CPU expert, 16 threads, run 36's host"))
    return {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "load_average": os.getloadavg(), "shape": {"hidden": args.hidden,
                                                       "inter": args.inter},
            "experts": experts, "rows": rows, "figures": figures}


def print_report(report: dict) -> None:
    for name, expert in report["experts"].items():
        b = expert["bytes"]
        print(f"down {name}: bytes/expert gguf {b['gguf']:,} int4/int8 {b['int4']:,} "
              f"bf16 {b['bf16']:,}; model (6144 experts) GiB "
              + ", ".join(f"{k} {v:.1f}" for k, v in expert["model_gib"].items()))
        print(f"  convert to int4/int8 {expert['convert_int_ms']:.1f} ms, "
              f"to bf16 {expert['dequant_bf16_ms']:.1f} ms an expert")
        print("  errors (relative to max |w| or max |y|): "
              + ", ".join(f"{k} {v:.2e}" for k, v in expert["errors"].items()))
    print(f"\n{'down':5} {'path':5} {'thr':>3} {'tok':>3} {'us/expert':>10} "
          f"{'GB/s fmt':>9} {'GB/s gguf':>9}")
    for r in report["rows"]:
        print(f"{r['down']:5} {r['path']:5} {r['threads']:>3} {r['tokens']:>3} {r['us']:>10.1f} "
              f"{r['format_gbps']:>9.2f} {r['gguf_gbps']:>9.2f}")
    print()
    print(format_figures(report["figures"], limit_header="llama.cpp"))
    print(f"load average {report['load_average']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print_report(report)
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
