"""Continuous batching on one GPU: aggregate decode tok/s by concurrent streams, and the time to
first token of a short request while a long prompt prefills (issue 22).

    python bench/batch_bench.py --model llama3-8b --random --streams 1 2 4 8 16 --json out.json
    python bench/batch_bench.py --gguf FILE.gguf [--llama-batched-bench PATH] --json out.json

Drives Engine.add/step directly (what the engine process does), so the figures are the
engine's, not HTTP's. For each stream count: N requests with distinct prompts start together;
decode tok/s is the tokens made after every sequence has its first token over that time.
Then a long prompt (--long-tokens) is added, and after its first prefill chunk a short request;
its TTFT is compared with one chunk's prefill time and its own prefill. The long prompt is
alone then, so its chunks are the engine's solo chunks (EngineConfig.prefill_solo_chunk_tokens,
when larger than --chunk-tokens): the chunk a request arriving mid-step waits behind.
With --gguf FILE the engine loads that file; --llama-batched-bench PATH then runs llama.cpp's
llama-batched-bench on the same file once the engine is closed (llamacpp_batched.py: the same
stream counts, prompt and generated lengths) and adds Strata/llama.cpp per stream count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llamacpp_batched.py


def engine_for(args):
    from strata.engine.core.engine import Engine
    from strata.engine.core.engine_config import EngineConfig

    extra = {"random_weights": args.model} if args.random and not args.gguf else {}
    model_path = args.gguf or args.model
    engine = Engine(EngineConfig(model_path=model_path, device=args.device, num_slots=args.slots,
                                 context_tokens=args.long_tokens + 1024,
                                 prefill_chunk_tokens=args.chunk_tokens,
                                 expert_cache=args.expert_cache, **extra))
    engine.load()
    return engine


def moe_batch_path(engine) -> str | None:
    """Which kernels a batch step's MoE layers take (fast/batch_graph._mlp_rows), or None for
    a dense model: so a row says whether quantized experts batched or went row by row."""
    from strata.engine.core.fast.moe_grouped import slot_layout
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.quant import expert_batch
    from strata.engine.core.quant.experts import is_quantized_experts

    moe = next((m for m in engine.model.modules() if isinstance(m, SparseMoE)), None)
    if moe is None:
        return None
    layout = slot_layout(moe)
    if moe.expert_weights is not None and layout is None:
        return "loop (no slot table: eager)"
    where = "slot table" if layout is not None else "resident"
    gate, up, down = ((layout.gate, layout.up, layout.down) if layout is not None else
                      (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj))
    if not is_quantized_experts(gate):
        return f"float pairs (moe_batch), {where}"
    table, offsets = (None, (0, 0, 0)) if layout is None else (layout.table,
                                                                layout.host_offsets)
    if expert_batch.supports(gate, up, down, table, offsets):
        return f"quantized batched (expert_batch), {where}"
    return f"quantized row by row (one-token kernels), {where}"


def sync() -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def take(steps, num_tokens: int) -> int:
    """Pull steps from a generate() iterator until num_tokens have come (a step may bring
    several); how many came."""
    count = 0
    while count < num_tokens:
        count += len(next(steps))
    return count


def prompt(vocab: int, seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (vocab - 2) + 1 for i in range(length)]


def run_streams(engine, num_streams: int, args) -> dict:
    from strata.engine.protocol import SamplingSpec

    vocab = engine.model_config.vocab_size
    spec = SamplingSpec(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=())
    for i in range(num_streams):
        engine.erase_slot(i)
        engine.add(f"s{i}", prompt(vocab, 1000 * num_streams + i, args.prompt_tokens), spec, i)
    started: set[str] = set()
    num_tokens = 0
    decode_start_s = None
    while engine.has_work:
        events = engine.step()
        for event in events:
            if event.token_ids and event.request_id not in started:
                started.add(event.request_id)
            elif decode_start_s is not None:
                num_tokens += len(event.token_ids)
        if decode_start_s is None and len(started) == num_streams:
            sync()
            decode_start_s = time.perf_counter()
    sync()
    elapsed_s = time.perf_counter() - decode_start_s
    return {"streams": num_streams, "decode_tokens": num_tokens, "decode_s": round(elapsed_s, 3),
            "aggregate_tok_s": round(num_tokens / elapsed_s, 1),
            "per_stream_tok_s": round(num_tokens / elapsed_s / num_streams, 1)}


def first_token_s(engine, request_id: str, tokens: list[int], slot: int) -> float:
    """Seconds from add() to the request's first token, run alone."""
    from strata.engine.protocol import SamplingSpec

    sync()
    start_s = time.perf_counter()
    engine.add(request_id, tokens, SamplingSpec(max_tokens=1), slot)
    while engine.has_work:
        engine.step()
    sync()
    return time.perf_counter() - start_s


def run_ttft(engine, args) -> dict:
    """The short request's TTFT while the long prompt prefills, against one chunk's time and
    its own prefill alone. Slots are not erased in between: an erase drops the prefill graphs,
    and their capture would be timed. Each short prompt differs from the last from its first
    token, so nothing of it is cached."""
    from strata.engine.protocol import SamplingSpec

    vocab = engine.model_config.vocab_size
    for i in range(2):
        engine.erase_slot(i)
    first_token_s(engine, "warm", prompt(vocab, 9, args.short_tokens), 1)  # captures its bucket
    engine.add("long", prompt(vocab, 7, args.long_tokens), SamplingSpec(max_tokens=8), 0)
    engine.step()  # the long prompt's first chunk
    sync()
    chunk_start_s = time.perf_counter()
    engine.step()  # a second chunk alone (a solo chunk): one chunk's time
    sync()
    chunk_s = time.perf_counter() - chunk_start_s
    sync()
    added_s = time.perf_counter()
    engine.add("short", prompt(vocab, 11, args.short_tokens), SamplingSpec(max_tokens=4), 1)
    ttft_s = None
    while engine.has_work:
        for event in engine.step():
            if event.request_id == "short" and event.token_ids and ttft_s is None:
                sync()
                ttft_s = time.perf_counter() - added_s
        if ttft_s is not None:
            engine.cancel("long")
    engine.step()
    alone_s = first_token_s(engine, "alone", prompt(vocab, 13, args.short_tokens), 1)
    return {"long_tokens": args.long_tokens, "chunk_tokens": args.chunk_tokens,
            "solo_chunk_tokens": engine.config.prefill_solo_chunk_tokens,
            "chunk_s": round(chunk_s, 4), "short_ttft_s": round(ttft_s, 4),
            "short_alone_s": round(alone_s, 4),
            "ttft_vs_chunk_plus_own": round(ttft_s / (chunk_s + alone_s), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--random", action="store_true", help="--model names a random preset")
    parser.add_argument("--gguf", help="a GGUF file to load instead of --model")
    parser.add_argument("--llama-batched-bench",
                        help="llama-batched-bench binary: llama.cpp on the same --gguf file")
    parser.add_argument("--llamacpp-timeout-s", type=float, default=300.0)
    parser.add_argument("--no-ttft", action="store_true",
                        help="skip the short-request-during-long-prefill row")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--long-tokens", type=int, default=32768)
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda", help="cpu for a dry run")
    parser.add_argument("--expert-cache", default="auto",
                        help="EngineConfig.expert_cache: auto, all, a slot count or a size "
                             "(fewer slots than experts: a partial cache, misses from host)")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    engine = engine_for(args)
    moe_path = moe_batch_path(engine)
    print(json.dumps({"moe_batch_path": moe_path,
                      "batch_graphs": engine._runner.batch is not None}), flush=True)
    # Warm-up: every stream count once, short, so each batch size's graphs are captured (and
    # kernels compiled) before timing; what that first run cost is kept in the JSON.
    warm_args = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    warmup = [run_streams(engine, n, warm_args) for n in args.streams]
    rows = [run_streams(engine, n, args) for n in args.streams]
    one = rows[0]["aggregate_tok_s"] if rows and rows[0]["streams"] == 1 else None
    for row in rows:
        row["vs_one_stream"] = round(row["aggregate_tok_s"] / one, 2) if one else None
        print(json.dumps(row), flush=True)
    ttft = None if args.no_ttft else run_ttft(engine, args)
    print(json.dumps(ttft), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"model": args.gguf or args.model, "gpu": gpu, "torch": torch.__version__,
              "expert_cache": args.expert_cache, "moe_batch_path": moe_path, "streams": rows,
              "warmup_streams": warmup, "ttft_during_long_prefill": ttft}
    if args.json:  # written now too: a failing peer keeps Strata's rows
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.gguf and args.llama_batched_bench:
        result |= llamacpp_peer(engine, rows, args)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


def llamacpp_peer(engine, rows: list[dict], args) -> dict:
    """Close the engine (its VRAM back), run llama-batched-bench on the same file, and print
    Strata/llama.cpp per stream count."""
    from llamacpp_batched import ratio_rows, run_batched

    engine.close()
    sync()
    peer = run_batched(args.llama_batched_bench, args.gguf, args.streams, args.prompt_tokens,
                       args.max_tokens, args.llamacpp_timeout_s)
    if "error" in peer:
        print(f"llama-batched-bench: {peer['error']}", file=sys.stderr, flush=True)
    ratios = ratio_rows(rows, peer["rows"])
    for row in ratios:
        print(json.dumps(row), flush=True)
    return {"llamacpp": peer, "vs_llamacpp": ratios}


if __name__ == "__main__":
    main()
