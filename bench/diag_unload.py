"""Where an unload's time goes: NVML's used VRAM over time against the engine's exit phases.

    python bench/diag_unload.py --model llama3-8b --json diag-unload.json

A diagnostic, not a benchmark. For each exit recipe an Engine with random weights is loaded in
a spawned process and answers once; then the recipe runs phase by phase while this process
polls NVML every 2 ms. Recipes: `close` + interpreter exit (what a plain process does),
arenas + os._exit, arenas + context reset + os._exit (what Engine.close_for_exit does now),
arenas + unpin host copies + os._exit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import write_json  # bench/report.py, next to this file
from unload_bench import used_vram_bytes  # next to this file

RECIPES = (("close", "exit"), ("arenas", "_exit"), ("arenas", "empty_cache", "reset", "_exit"),
           ("arenas", "unpin", "_exit"))
BASELINE_SLACK_BYTES = 64 << 20


def run_phase(engine, phase: str) -> None:
    import torch

    if phase == "close":
        engine.close()
    elif phase == "arenas":
        engine.memory.arenas.close()
    elif phase == "unpin":
        engine.slots.close()
        engine.memory.weights.host_copy.close()
    elif phase == "empty_cache":
        torch.cuda.empty_cache()
    elif phase == "reset":
        from strata.engine.core.memory.cuda_vmm import reset_primary_context

        reset_primary_context(0)
    else:
        raise ValueError(f"unknown phase {phase!r}")


def child(events: multiprocessing.Queue, go: multiprocessing.Queue, model: str,
          recipe: tuple[str, ...]) -> None:
    from strata.engine.core.engine import Engine
    from strata.engine.core.engine_config import EngineConfig
    from strata.engine.protocol import SamplingSpec

    engine = Engine(EngineConfig(model_path=f"random:{model}", random_weights=model,
                                 device="cuda", context_tokens=4096))
    engine.load()
    for _ in engine.generate(list(range(1, 17)), SamplingSpec(max_tokens=4, temperature=0.0)):
        pass
    events.put(("ready", time.time()))
    go.get()
    marks = [("go", time.time())]
    for phase in recipe:
        if phase in ("exit", "_exit"):
            events.put(("marks", [*marks, (phase, time.time())]))
            time.sleep(0.05)  # let the queue's feeder thread flush
            if phase == "_exit":
                os._exit(0)
            sys.exit(0)
        run_phase(engine, phase)
        marks.append((phase, time.time()))


def measure(model: str, recipe: tuple[str, ...]) -> dict:
    ctx = multiprocessing.get_context("spawn")
    baseline = used_vram_bytes()
    events, go = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=child, args=(events, go, model, recipe))
    process.start()
    events.get(timeout=300)
    loaded = used_vram_bytes()
    timeline, marks = [], None
    started = time.time()
    go.put("go")
    while time.time() - started < 20:
        used = used_vram_bytes()
        timeline.append((time.time() - started, used))
        if marks is None:
            try:
                marks = events.get_nowait()[1]
            except queue.Empty:
                pass
        if used <= baseline + BASELINE_SLACK_BYTES and not process.is_alive():
            break
        time.sleep(0.002)
    process.join(10)
    back_s = next((t for t, u in timeline if u <= baseline + BASELINE_SLACK_BYTES), None)
    changes = [(round(t, 4), round((u - baseline) / 2**20))
               for i, (t, u) in enumerate(timeline)
               if i == 0 or abs(u - timeline[i - 1][1]) > 32 << 20]
    return {"loaded_mib": (loaded - baseline) / 2**20, "back_to_baseline_s": back_s,
            "marks": [(name, round(t - started, 4)) for name, t in marks or []],
            "mib_above_baseline_when_it_changed": changes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--json", help="write the timelines here")
    args = parser.parse_args()
    results = {}
    for recipe in RECIPES:
        name = "+".join(recipe)
        results[name] = measure(args.model, recipe)
        print(json.dumps({name: results[name]}), flush=True)
    write_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
