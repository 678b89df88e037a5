"""Prefill time with the element-wise groups compiled, eager, or eager with the MoE block
compiled, per prompt length: where compiling pays.

    python bench/diag_prefill_ops.py [--models qwen3-30b-a3b smollm2-135m llama3-8b]
                                     [--tokens 512 1024 2048 4096]

A compiled call costs ~100 us of host time against ~10 us for an eager op, so for a small
model or a short prompt, where the GPU work per op is small, eager can win. Best of 5 after a
warm run, random weights, bf16, one GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from limits import best_wall_s
from speed_rows import _prompt

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fused_views import fuse_by_copy
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model, random_weights_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+",
                        default=["qwen3-30b-a3b", "smollm2-135m", "llama3-8b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    args = parser.parse_args()
    device = torch.device("cuda")
    for label in args.models:
        model = build_random_model(random_weights_config(label), device, torch.bfloat16, seed=0)
        fuse_by_copy(model)
        decoder = GraphDecoder(model)
        compiled = decoder.prefill_ops
        variants = [("compiled", compiled), ("eager", EAGER_OPS)]
        if model.config.is_moe and compiled.moe_block is not None:
            variants.append(("eager + compiled MoE block",
                             dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)))
        for num_tokens in args.tokens:
            kv = KVCache.for_config(model.config, num_tokens, torch.bfloat16, device)
            prompt = _prompt(model.config, num_tokens, device)
            for name, ops in variants:
                decoder.prefill_ops = ops
                seconds = best_wall_s(lambda d=decoder, kv=kv, p=prompt: d.prefill(kv, p, 0), 5)
                print(f"{label} {num_tokens} tok {name}: {seconds * 1e3:.2f} ms "
                      f"({num_tokens / seconds:.0f} tok/s)", flush=True)
            del kv
        del model, decoder
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
