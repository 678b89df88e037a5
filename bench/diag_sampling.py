"""Decode tok/s per sampling mode on the CUDA-graph path: what each sampling feature costs.

    python bench/diag_sampling.py [--preset smollm2-135m] [--tokens 512]

Greedy is the baseline; llama.cpp's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p
0.05) are what a request without sampling fields gets for most models; then the same with
repetition penalties, logit_bias, and top_logprobs=5. Random bf16 weights of the preset's shape.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed_rows import engine_model

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1)
MODES = {
    "greedy": SamplingSpec(temperature=0.0),
    "llama.cpp defaults": SamplingSpec(**DEFAULTS),
    "defaults, top_k off": SamplingSpec(**{**DEFAULTS, "top_k": 0}),
    "+ penalties (last 64)": SamplingSpec(**DEFAULTS, repeat_penalty=1.1, presence_penalty=0.5,
                                          frequency_penalty=0.5),
    "+ logit_bias": SamplingSpec(**DEFAULTS, logit_bias=((5, -100.0), (7, 2.0))),
    "+ top_logprobs 5": SamplingSpec(**DEFAULTS, num_logprobs=5),
}


def tokens_per_s(decoder: GraphDecoder, spec: SamplingSpec, num_tokens: int) -> float:
    config = decoder.model.config
    kv = KVCache.for_config(config, 1024 + num_tokens, torch.bfloat16, "cuda")
    prompt = list(range(1, 65))
    for _ in decoder.generate(kv, prompt, spec, 16):  # capture this mode's graphs
        pass
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    count = sum(1 for _ in decoder.generate(kv, prompt, spec, num_tokens))
    torch.cuda.synchronize()
    return count / (time.perf_counter() - started_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    decoder = GraphDecoder(engine_model(args.preset, torch.device("cuda")))
    base = None
    print(f"{'mode':<24} {'tok/s':>9} {'vs greedy':>9}")
    for name, spec in MODES.items():
        rate = tokens_per_s(decoder, spec, args.tokens)
        base = base or rate
        print(f"{name:<24} {rate:9.1f} {rate / base:9.3f}")


if __name__ == "__main__":
    main()
