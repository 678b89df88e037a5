"""Prefill time per prompt length with the element-wise groups compiled, eager, or eager with
the MoE block compiled; called from Python and, with --replay, replayed from a CUDA graph.

    python bench/diag_prefill_ops.py [--models qwen3-30b-a3b smollm2-135m llama3-8b]
                                     [--tokens 512 1024 2048 4096] [--replay]
                                     [--profile-model smollm2-135m]

A compiled call costs ~100 us of host time against ~10 us for an eager op, so for a small
model or a short prompt, where the GPU work per op is small, eager can win. --replay also
captures each variant's prefill (same prompt, same KV cache, start at 0) and replays it: the
difference is the host's share of a called prefill (fast/prefill_graph.py). --profile-model:
the host ops of one eager prefill of the first length, by self CPU time. Best of 5 after a
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
from speed_rows import _prompt, engine_model

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fast.side_stream import side_stream
from strata.engine.core.kv_cache import KVCache


def captured(fn, device: torch.device) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph after a warm-up on a side stream."""
    with side_stream(device):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replayed(run, called_s: float, device: torch.device) -> str:
    try:
        graph = captured(run, device)
    except RuntimeError as exc:  # a capture fails on a host sync: say which
        return f", capture failed: {type(exc).__name__}: {exc}"[:200]
    replay_s = best_wall_s(graph.replay, 5)
    return f", {replay_s * 1e3:.2f} ms replayed ({called_s / replay_s:.2f}x)"


def profile_host(decoder: GraphDecoder, kv: KVCache, prompt: torch.Tensor) -> None:
    decoder.prefill(kv, prompt, 0)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decoder.prefill(kv, prompt, 0)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+",
                        default=["qwen3-30b-a3b", "smollm2-135m", "llama3-8b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--replay", action="store_true",
                        help="also replay each prefill from a captured CUDA graph")
    parser.add_argument("--profile-model", help="profile the host ops of this model's prefill")
    args = parser.parse_args()
    device = torch.device("cuda")
    for label in args.models:
        model = engine_model(label, device)
        decoder = GraphDecoder(model)
        compiled = decoder.prefill_ops
        variants = [("compiled", compiled), ("eager", EAGER_OPS)]
        if model.config.is_moe and compiled.moe_block is not None:
            variants.append(("eager + compiled MoE block",
                             dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)))
        for num_tokens in args.tokens:
            kv = KVCache.for_config(model.config, num_tokens, torch.bfloat16, device)
            prompt = _prompt(model.config, num_tokens, device)
            if label == args.profile_model and num_tokens == args.tokens[0]:
                decoder.prefill_ops = variants[-1][1]
                profile_host(decoder, kv, prompt)
            for name, ops in variants:
                decoder.prefill_ops = ops
                def run(d=decoder, kv=kv, p=prompt):
                    return d.prefill(kv, p, 0)

                seconds = best_wall_s(run, 5)
                print(f"{label} {num_tokens} tok {name}: {seconds * 1e3:.2f} ms "
                      f"({num_tokens / seconds:.0f} tok/s)"
                      + (replayed(run, seconds, device) if args.replay else ""), flush=True)
            del kv
        del model, decoder
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
