"""Where a load's seconds and a sleeping engine's VRAM go (issue 18 items 5 and 6).

    python bench/diag_sleep_load.py --model PATH_OR_PRESET [--random] --json out.json

A diagnostic, not a benchmark. Parts, each in a fresh spawned process:
- `context`: the VRAM a bare CUDA context of torch holds (one tiny tensor), per NVML;
- `kernels`: the same after cuBLAS GEMMs and torch's attention ran once, their tensors freed
  (the kernels' code stays loaded: a floor no sleep can go below without ending the process);
- `load` (twice: cold, then with the kernel caches the first left on disk): Engine.load() under
  cProfile, the wall time and the functions with the most cumulative time;
- `sleep`: load, answer one 2k-token prompt, sleep; then NVML's figure for this process,
  torch's allocated/reserved bytes, and the largest CUDA tensors still alive (what holds VRAM
  that sleep did not give back).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import multiprocessing
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata

MIB = 1 << 20


def process_used_mib() -> float | None:
    """NVML's used VRAM of this process on GPU 0 (None where NVML does not say)."""
    from strata.engine.core.memory.vram import gpu_processes

    for process in gpu_processes(0):
        if process.pid == os.getpid() and process.used_bytes is not None:
            return process.used_bytes / MIB
    return None


def engine_config(args):
    from strata.engine.core.engine_config import EngineConfig

    if args.random:
        return EngineConfig(model_path=args.model, device="cuda", random_weights=args.model,
                            context_tokens=args.context_tokens)
    return EngineConfig(model_path=args.model, device="cuda", context_tokens=args.context_tokens)


def part_context(args, out):
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    out.put({"part": "context", "used_mib": process_used_mib()})


def part_kernels(args, out):
    """A bare context after the library kernels a decode loads (cuBLAS GEMMs, torch's
    attention and element-wise kernels), their tensors freed: the floor a process that has
    run a model keeps, with nothing of the model left."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 16, 512):
        (x[:1].expand(rows, -1) @ w).float().softmax(-1)
    q = torch.randn(1, 16, 512, 128, device="cuda", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.cuda.synchronize()
    del x, w, q
    torch.cuda.empty_cache()
    out.put({"part": "kernels", "used_mib": process_used_mib()})


def part_load(args, out):
    started_s = time.perf_counter()
    from strata.engine.core.engine import Engine

    import_s = time.perf_counter() - started_s
    engine = Engine(engine_config(args))
    profile = cProfile.Profile()
    started_s = time.perf_counter()
    profile.enable()
    engine.load()
    profile.disable()
    load_s = time.perf_counter() - started_s
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    out.put({"part": "load", "import_s": round(import_s, 3), "load_s": round(load_s, 3),
             "engine_load_time_s": engine.load_time_s, "profile": text.getvalue()})
    engine.close_for_exit()
    os._exit(0)


def live_cuda_tensors(limit: int) -> list[dict]:
    import torch

    seen: dict[int, dict] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                key = storage.data_ptr()
                if key not in seen:
                    seen[key] = {"bytes": storage.nbytes(), "shape": list(obj.shape),
                                 "dtype": str(obj.dtype)}
        except Exception:  # noqa: BLE001 - a diagnostic walks every object
            continue
    rows = sorted(seen.values(), key=lambda row: -row["bytes"])
    return rows[:limit]


def graph_holders() -> list[str]:
    """Each live CUDAGraph (its private pool holds memory) and who refers to it."""
    import torch

    rows = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.cuda.CUDAGraph):
            holders = [type(r).__name__ for r in gc.get_referrers(obj)][:4]
            for ref in gc.get_referrers(obj):
                if isinstance(ref, dict):
                    holders += [type(r).__name__ for r in gc.get_referrers(ref)][:3]
            rows.append(",".join(holders))
    return rows


def pool_segments() -> dict[str, float]:
    """Reserved MiB per allocator pool: (0, 0) is the default pool, others are graph pools."""
    import torch

    pools: dict[str, float] = {}
    for segment in torch.cuda.memory_snapshot():
        key = str(segment.get("segment_pool_id"))
        pools[key] = pools.get(key, 0.0) + segment["total_size"] / MIB
    return pools


def part_sleep(args, out):
    import torch

    from strata.engine.core.engine import Engine
    from strata.engine.protocol import SamplingSpec

    engine = Engine(engine_config(args))
    engine.load()
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919) % (vocab - 1) + 1 for i in range(args.prompt_tokens)]
    for _ in engine.generate(prompt, SamplingSpec(max_tokens=32)):
        pass
    torch.cuda.synchronize()
    awake_mib = process_used_mib()
    result = engine.sleep()
    torch.cuda.synchronize()
    gc.collect()
    row = {"part": "sleep", "awake_mib": awake_mib, "asleep_mib": process_used_mib(),
           "freed_bytes": result.get("freed_bytes"),
           "torch_allocated_mib": torch.cuda.memory_allocated() / MIB,
           "torch_reserved_mib": torch.cuda.memory_reserved() / MIB,
           "live_tensors": live_cuda_tensors(8), "graphs": graph_holders(),
           "pools_mib": pool_segments()}
    torch.cuda.empty_cache()
    row["after_empty_cache_mib"] = process_used_mib()
    out.put(row)
    engine.close_for_exit()
    os._exit(0)


PARTS = {"context": part_context, "kernels": part_kernels, "load": part_load,
         "sleep": part_sleep}


def run_part(name: str, args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    process = ctx.Process(target=PARTS[name], args=(args, out))
    process.start()
    try:
        row = out.get(timeout=args.timeout_s)
    except Exception as exc:  # noqa: BLE001 - report and go on with the next part
        row = {"part": name, "error": repr(exc)}
    process.join(30)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF/HF path, or a preset with --random")
    parser.add_argument("--random", action="store_true", help="--model names a random preset")
    parser.add_argument("--context-tokens", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--parts", nargs="+", default=["context", "load", "load", "sleep"])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.parts:
        row = run_part(name, args)
        rows.append(row)
        printable = {k: v for k, v in row.items() if k != "profile"}
        print(json.dumps(printable), flush=True)
        if "profile" in row:
            print(row["profile"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
