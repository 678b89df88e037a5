"""The transformers peer for `strata bench`, run in its own process (own memory, own timeout).

    python bench/peer_transformers.py --model llama3-8b --prompt-tokens 512 --decode-tokens 64

Random weights of the same shape, bf16 on CUDA, static KV cache; an MoE's experts run as
transformers' grouped GEMMs (`experts_implementation="grouped_mm"`, its default where torch has
them, asked for explicitly so a fallback is an error, not a silent eager loop). Two stages,
each printing a line `PEER_JSON {...}` as soon as it is done, so a timeout keeps what was
measured:

1. eager: prefill (logits_to_keep=1) and decoding with `disable_compile` (no torch.compile);
2. compiled (unless --no-compile): generate's own automatic torch.compile of the decode step
   (mode reduce-overhead, fullgraph; the prompt's forward stays eager), transformers' fastest
   documented decoding setup. Compiling takes about a minute for a 30-layer model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def run(args) -> dict:
    import transformers

    from strata.engine.core.random_weights import random_weights_hf_config

    hf = random_weights_hf_config(args.model)
    model_type = hf.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **hf)
    t0 = time.perf_counter()
    options = {"experts_implementation": args.experts_implementation} \
        if getattr(config, "num_experts", None) else {}
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              **options)
    model.eval()
    result = {"model": args.model, "transformers": transformers.__version__,
              "build_s": time.perf_counter() - t0}
    if options:
        result["experts"] = model.get_experts_implementation()[""]
    gen = torch.Generator().manual_seed(0)
    prefill_ids = torch.randint(0, config.vocab_size, (1, args.prefill_tokens), generator=gen).to(args.device)
    with torch.no_grad():
        model(prefill_ids[:, :512], logits_to_keep=1)  # warm-up
        seconds = min(_timed(lambda: model(prefill_ids, logits_to_keep=1)) for _ in range(2))
    result["prefill_tok_s"] = args.prefill_tokens / seconds

    prompt = prefill_ids[:, : args.prompt_tokens]
    model.generation_config.cache_implementation = "static"

    def decode_rate(is_compiled: bool) -> tuple[float, float]:
        """(decode tok/s, TTFT ms) of greedy generate after a warm-up (which compiles)."""
        model.generation_config.disable_compile = not is_compiled

        def generate(n: int):
            return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)

        with torch.no_grad():
            generate(args.decode_tokens)
            one = min(_timed(lambda: generate(1)) for _ in range(2))
            full = min(_timed(lambda: generate(args.decode_tokens)) for _ in range(2))
        # Timing noise can make the difference vanish on a tiny model: no figure, not a wrong one.
        rate = (args.decode_tokens - 1) / (full - one) if full > one else float("nan")
        return rate, one * 1e3

    t0 = time.perf_counter()
    result["decode_tok_s"], result["ttft_ms"] = decode_rate(is_compiled=False)
    result["compiled"], result["eager_s"] = False, time.perf_counter() - t0
    print("PEER_JSON " + json.dumps(result), flush=True)
    if not args.no_compile:
        t0 = time.perf_counter()
        result["eager_decode_tok_s"] = result["decode_tok_s"]
        result["decode_tok_s"], result["ttft_ms"] = decode_rate(is_compiled=True)
        result["compiled"], result["compile_s"] = True, time.perf_counter() - t0
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true", help="stop after the eager stage")
    parser.add_argument("--device", default="cuda", help="cpu only for a smoke test")
    parser.add_argument("--experts-implementation", default="grouped_mm",
                        help="an MoE's transformers experts_implementation (grouped_mm, "
                        "batched_mm, eager)")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - reported as the row's note, not a crash
        result = {"model": args.model, "error": f"{type(exc).__name__}: {exc}"[:500]}
    print("PEER_JSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
