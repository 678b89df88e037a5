"""Where a long prompt's prefill spends the host's time: Python functions and torch ops.

    python bench/diag_prefill_host.py FILE.gguf [--tokens 4096] [--top 30]

Run 24a's 8B Q4_K_M prompt of 4096 tokens kept the GPU busy 116 ms of a 231 ms prefill: the
host, not the GPU, set the row (and its spread between calls). This loads the file as
quant_bench does (Engine, deferred compiles run), prefills one warm prompt, then one more
under cProfile (Python functions by own and cumulative time) and one under torch.profiler
(CPU ops by self time, against the GPU's busy time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from strata.engine.core.process import use_engine_allocator

use_engine_allocator()  # before torch: the allocator the engine process runs

from batch_bench import first_token_s, prompt, sync


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from strata.engine.core.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=args.gguf, device=args.device, num_slots=1,
                                 context_tokens=args.tokens + 128))
    engine.load()
    for name in engine.run_deferred_work():
        print("deferred:", name, flush=True)
    vocab = engine.model_config.vocab_size
    for seed in range(2):  # warm: captures, first compiles, KV mapped
        first_token_s(engine, f"warm-{seed}", prompt(vocab, 11 * args.tokens + seed,
                                                     args.tokens), 0)
    plain_s = [first_token_s(engine, f"plain-{seed}", prompt(vocab, 13 * args.tokens + seed,
                                                             args.tokens), 0)
               for seed in range(3)]
    print(f"prefill of {args.tokens} tokens, unprofiled: "
          + ", ".join(f"{s * 1e3:.1f}" for s in plain_s) + " ms")

    profiler = cProfile.Profile()
    ids = prompt(vocab, 17 * args.tokens, args.tokens)
    sync()
    started_s = time.perf_counter()
    profiler.enable()
    first_token_s(engine, "cprofile", ids, 0)
    profiler.disable()
    print(f"under cProfile: {(time.perf_counter() - started_s) * 1e3:.1f} ms")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        print(f"== Python functions by {key}")
        print(text.getvalue()[-12000:])

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    ids = prompt(vocab, 19 * args.tokens, args.tokens)
    with profile(activities=activities) as prof:
        wall_s = first_token_s(engine, "torch-profile", ids, 0)
    print(f"== torch ops by self CPU time (one prompt, {wall_s * 1e3:.1f} ms under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                    max_name_column_width=70))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
