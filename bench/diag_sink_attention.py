"""GPT-OSS's prefill attention: the fused sink kernel against the torch path it replaces.

    python bench/diag_sink_attention.py --json diag-sink-attention.json

Times kernels/sink_attention.py's Triton kernel and models/gpt_oss.sink_attention (the torch
path before it) at gpt-oss-20b's attention shape (64 query / 8 kv heads, head size 64, bf16),
a window of 128 (alternate layers) and none, for a first 4096-token chunk and a 2048-token
one after 2048 cached keys; flash SDPA (no sinks: not the same result) as a floor. Also times
a sweep of the kernel's block sizes (--sweep), from which block_plan took its pick (run 36).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # next to this file
from limits import time_s
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.kernels import sink_attention as sink_kernel
from strata.engine.core.kernels.prefill_attention import flash_attention
from strata.engine.core.models.gpt_oss import sink_attention

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64
CASES = ((4096, 4096), (2048, 4096))  # (queries T, keys S)
SWEEP = ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3))


def _inputs(num_tokens: int, num_keys: int):
    def rows(n: int, heads: int) -> torch.Tensor:  # transposed views, as attention_prefill's
        return torch.randn(n, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(0, 1)

    return (rows(num_tokens, HEADS), rows(num_keys, KV_HEADS), rows(num_keys, KV_HEADS),
            torch.randn(HEADS, device="cuda") * 2)


def _paths(inputs, window: int, sweep: bool) -> dict:
    """name -> a call of that path on inputs (q, keys, values, sinks) with window."""
    q, keys, values, sinks = inputs
    paths = {
        "torch": lambda: sink_attention(q, keys, values, sinks, window),
        "fused": lambda: sink_kernel.fused_sink_attention(q, keys, values, sinks, window),
        "flash_no_sinks": lambda: flash_attention(q, keys, values, window=window or None),
    }
    for plan in SWEEP if sweep else ():
        paths[f"fused_{'x'.join(map(str, plan))}"] = (
            lambda plan=plan: _with_plan(plan, q, keys, values, sinks, window))
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table here")
    parser.add_argument("--sweep", action="store_true", help="time other block sizes too")
    args = parser.parse_args()
    rows = []
    for num_tokens, num_keys in CASES:
        inputs = _inputs(num_tokens, num_keys)
        for window in (0, 128):
            with torch.inference_mode():
                paths = _paths(inputs, window, args.sweep)
                reference = paths["torch"]().float()
                for name, fn in paths.items():
                    row = {"tokens": num_tokens, "keys": num_keys, "window": window,
                           "path": name}
                    out = fn()
                    row |= {"ms": 1e3 * time_s(fn, 10),
                            "max_abs_error": (out.float() - reference).abs().max().item()}
                    rows.append(row)
                    print(json.dumps(row))
    write_json(rows, args.json)
    return 0


def _with_plan(plan, *args):
    """fused_sink_attention with block_plan answering plan (BLOCK_M, BLOCK_N, warps, stages)."""
    saved = sink_kernel.block_plan
    sink_kernel.block_plan = lambda num_tokens: plan
    try:
        return sink_kernel.fused_sink_attention(*args)
    finally:
        sink_kernel.block_plan = saved


if __name__ == "__main__":
    raise SystemExit(main())
