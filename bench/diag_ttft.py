"""Time to first token of a short prompt, before and after decoding with CUDA graphs.

    python bench/diag_ttft.py [--model qwen3-30b-a3b] [--prompt-tokens 512]

A diagnostic for the suite's TTFT row: a 512-token Qwen3-30B-A3B prompt took 120 ms in one
run, against 62 ms a session earlier and 69 ms for a 4096-token prefill in the same run. It
times the prefill and the first sample separately (best of 3), on a fresh decoder, then again
after 64 graph-decoded tokens, with the decode step's Triton projections on and off.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from limits import best_wall_s
from speed_rows import GREEDY, _prompt, engine_model

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = engine_model(args.model, device)
    kv = KVCache.for_config(model.config, 2048, torch.bfloat16, device)
    prompt = _prompt(model.config, args.prompt_tokens, device)
    ids = prompt.tolist()
    for dense in (True, False):
        decoder = GraphDecoder(model)
        decoder.ops = dataclasses.replace(decoder.ops, dense_kernels=dense,
                                          pdl=decoder.ops.pdl and dense)
        decoder.prefill(kv, prompt, 0)  # compile what this length needs
        for when in ("fresh decoder", "after graph decode"):
            prefill_ms = best_wall_s(lambda d=decoder: d.prefill(kv, prompt, 0), 3) * 1e3
            ttft_ms = best_wall_s(lambda d=decoder: next(iter(d.generate(kv, ids, GREEDY, 1))),
                                  3) * 1e3
            print(f"{args.model} {args.prompt_tokens} tok, dense_kernels={dense}, {when}: "
                  f"prefill {prefill_ms:.1f} ms, TTFT {ttft_ms:.1f} ms", flush=True)
            first = decoder.sample_first(decoder.prefill(kv, prompt, 0), GREEDY)
            decoder.prepare(kv, args.prompt_tokens, 64, GREEDY)
            list(decoder.decode(kv, first, args.prompt_tokens, 64, GREEDY))
        decoder.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
