"""Where a session offload and restore spend their time: each phase synchronized and timed.

    python bench/diag_session.py --json diag-session.json

A diagnostic, not a benchmark: synchronizing between phases removes the overlap the engine
relies on, which is the point (it shows what each phase costs alone). Same model and session
as bench/lifecycle_bench.py: a 32k-token KV of the Qwen3-30B-A3B-shaped model with 14 layers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from lifecycle_bench import MODELS, SESSION_TOKENS, fill_session  # next to this file
from report import write_json  # bench/report.py, next to this file

from strata.engine.core.engine import Engine
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.snapshots.kv_state import KVSnapshot, SlotCache
from strata.units import GIB

SLOT = 2


def timed_ms(fn):
    torch.cuda.synchronize()
    started_s = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - started_s) * 1e3


def one_cycle(engine: Engine) -> dict[str, float]:
    """Offload then restore SLOT phase by phase; returns milliseconds per phase."""
    slots, kv_arena = engine.slots, engine.kv_arena
    ms: dict[str, float] = {}
    cache = slots.resident[SLOT]
    snapshot, ms["capture"] = timed_ms(
        lambda: KVSnapshot.capture(cache, pool=slots.store.host_pool))
    _, ms["put"] = timed_ms(lambda: slots.store.put(SLOT, snapshot))
    _, ms["release"] = timed_ms(lambda: slots._release(SLOT))
    _, ms["empty_cache"] = timed_ms(torch.cuda.empty_cache)
    taken, ms["take"] = timed_ms(lambda: slots.store.take(SLOT))
    kv, ms["map_and_zero"] = timed_ms(lambda: kv_arena.make_kv(SLOT, taken.num_tokens))
    kv_arena.release_slot(SLOT)
    kv, ms["make_kv_empty"] = timed_ms(lambda: kv_arena.make_kv(SLOT))
    restored, ms["fill"] = timed_ms(lambda: SlotCache.from_state(taken.state, taken.metadata, kv))
    slots.resident[SLOT] = restored
    return ms


def engine_offload_ms(engine: Engine, cycles: int = 3) -> dict[str, list[float]]:
    """The real offload and restore (overlapped), timed whole, then one offload under cProfile:
    whatever the phases above do not add up to shows in its host profile."""
    import cProfile
    import pstats

    times: dict[str, list[float]] = {"offload": [], "restore": []}
    for _ in range(cycles):
        _, ms = timed_ms(engine.offload_session)
        times["offload"].append(ms)
        _, ms = timed_ms(engine.restore_session)
        times["restore"].append(ms)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.offload_session()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    engine.restore_session()
    return times


def flat_copy_ms(nbytes: int) -> dict[str, float]:
    """One pinned copy of the same bytes each way: the floor for capture and restore."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):  # the second pass is the figure
        _, h2d = timed_ms(lambda: device.copy_(host, non_blocking=True))
        _, d2h = timed_ms(lambda: host.copy_(device, non_blocking=True))
    return {"flat_h2d": h2d, "flat_d2h": d2h}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the phases here")
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="diag-session-"))
    (workdir / "config.json").write_text(json.dumps(MODELS["qwen3-30b-a3b-mini"]))
    engine = Engine(EngineConfig(
        model_path="random:diag", random_weights=str(workdir / "config.json"), device="cuda",
        context_tokens=SESSION_TOKENS + 256, expert_cache="all",
        snapshot_dir=str(workdir / "snapshots"), snapshot_ram_budget_bytes=32 * GIB))
    engine.load()
    kv_bytes = fill_session(engine, SLOT, SESSION_TOKENS)
    report = {"kv_bytes": kv_bytes, "chunk_bytes": engine.kv_arena.chunk_bytes,
              "regions": engine.kv_arena.num_regions, "cycles_ms": []}
    for cycle in range(args.cycles):  # the first cycle allocates and pins the snapshot pool
        phases = one_cycle(engine)
        report["cycles_ms"].append(phases)
        print(cycle, {k: round(v, 2) for k, v in phases.items()}, flush=True)
    report["engine_offload_ms"] = engine_offload_ms(engine)
    print("engine offload / restore ms:", report["engine_offload_ms"])
    report["flat_ms"] = flat_copy_ms(kv_bytes)
    print(f"{kv_bytes / GIB:.3f} GiB; flat copies {report['flat_ms']}")
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
