"""The transformers peer for `strata bench`, run in its own process (own memory, own timeout).

    python bench/peer_transformers.py --model llama3-8b --prompt-tokens 512 --decode-tokens 64

Random weights of the same shape, bf16 on CUDA. Decode uses a static cache and
torch.compile(mode="reduce-overhead", fullgraph=True), transformers' fastest documented
decoding setup; --no-compile measures eager decoding with the static cache. Prints one line
`PEER_JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(args) -> dict:
    import transformers

    from strata.engine.core.random_weights import random_weights_hf_config

    hf = random_weights_hf_config(args.model)
    model_type = hf.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **hf)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    result = {"model": args.model, "transformers": transformers.__version__,
              "build_s": time.perf_counter() - t0}
    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, config.vocab_size, (1, args.prefill_tokens), generator=gen).cuda()
    with torch.no_grad():
        model(prefill_ids[:, :512], logits_to_keep=1)  # warm-up
        seconds = min(_timed(lambda: model(prefill_ids, logits_to_keep=1)) for _ in range(2))
    result["prefill_tok_s"] = args.prefill_tokens / seconds

    prompt = prefill_ids[:, : args.prompt_tokens]
    model.generation_config.cache_implementation = "static"
    result["compiled"] = not args.no_compile
    if not args.no_compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def generate(n: int):
        return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)

    t0 = time.perf_counter()
    with torch.no_grad():
        generate(args.decode_tokens)  # compiles (prefill and decode shapes)
        generate(args.decode_tokens)
        result["warmup_s"] = time.perf_counter() - t0
        one = min(_timed(lambda: generate(1)) for _ in range(2))
        full = min(_timed(lambda: generate(args.decode_tokens)) for _ in range(2))
    result["ttft_ms"] = one * 1e3
    result["decode_tok_s"] = (args.decode_tokens - 1) / (full - one)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - reported as the row's note, not a crash
        result = {"model": args.model, "error": f"{type(exc).__name__}: {exc}"[:500]}
    print("PEER_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
