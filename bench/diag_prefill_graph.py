"""Prefill of a fresh prompt eagerly against the same prefill replayed from a CUDA graph: how
much of a chunk's time is the host's.

    python bench/diag_prefill_graph.py [--models smollm2-135m llama3-8b qwen3-30b-a3b]
                                       [--tokens 512 4096] [--profile-model smollm2-135m]

For each model and prompt length: the engine's prefill with compiled and with eager element-wise
groups, each called from Python and replayed from one captured CUDA graph (same prompt, same
KV cache, start at 0). With --profile-model, the host ops of one eager prefill of the first
length, by self CPU time. Best of 5 after a warm run, random weights, bf16, one GPU.
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


def captured(fn, device: torch.device) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph after a warm-up on a side stream."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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
                        default=["smollm2-135m", "llama3-8b", "qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--profile-model", default="smollm2-135m")
    args = parser.parse_args()
    device = torch.device("cuda")
    for label in args.models:
        model = build_random_model(random_weights_config(label), device, torch.bfloat16, seed=0)
        fuse_by_copy(model)
        decoder = GraphDecoder(model)
        compiled = decoder.prefill_ops
        eager = dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)
        for num_tokens in args.tokens:
            kv = KVCache.for_config(model.config, num_tokens, torch.bfloat16, device)
            prompt = _prompt(model.config, num_tokens, device)
            if label == args.profile_model and num_tokens == args.tokens[0]:
                decoder.prefill_ops = eager
                profile_host(decoder, kv, prompt)
            for name, ops in (("compiled", compiled), ("eager", eager)):
                decoder.prefill_ops = ops
                run = (lambda d=decoder, kv=kv, p=prompt: d.prefill(kv, p, 0))
                called_s = best_wall_s(run, 5)
                try:
                    graph = captured(run, device)
                    replay_s = best_wall_s(graph.replay, 5)
                    del graph
                    replayed = f"{replay_s * 1e3:.2f} ms replayed ({called_s / replay_s:.2f}x)"
                except RuntimeError as exc:  # a capture fails on a host sync: say which
                    replayed = f"capture failed: {type(exc).__name__}: {exc}"[:200]
                print(f"{label} {num_tokens} tok {name}: {called_s * 1e3:.2f} ms called, "
                      f"{replayed}", flush=True)
            del kv
        del model, decoder
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
