"""Where a partial expert cache's greedy tokens part from the bf16 reference (issue 19, run
20): the tiny 4-layer K-/I-quant Qwen3-MoE of tests/gpu/test_quant_experts_cuda.py (two slot
classes), its three runs (24 of 32 slots; after release + refill; shrunk to 16), under each
switch that takes a piece of the fast path away.

Per mode, the first token where a run differs from the reference (None: equal). With
--check-slots the default mode also checks, after every token, that the device slot table
equals the cache's mirror in class-local numbers (ExpertStore.local_table), that the mirror
names what the cache holds, and that every resident slot holds its expert's bytes from the
host copy (ExpertStore.verify_slots).

    python bench/diag_slot_classes.py [--modes default auto no-graphs no-dp4a no-fast]
                                      [--check-slots]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' helpers

# mode -> (environment, EngineConfig fields, expert_cache)
MODES = {
    "default": ({}, {}, "24"),
    "auto": ({}, {}, "auto"),
    "no-graphs": ({}, {"fast_cuda_graphs": False}, "24"),
    "no-dp4a": ({"STRATA_DP4A": "0"}, {}, "24"),
    "no-pdl": ({"STRATA_PDL": "0"}, {}, "24"),
    "no-fast": ({}, {"fast_decode": False}, "24"),
}
SHRUNK_SLOTS = 16


def _engine(path: Path, quantized: bool, expert_cache: str, **fields):
    from strata.engine.core.engine import Engine, EngineConfig

    os.environ["STRATA_QUANTIZED"] = "1" if quantized else "0"
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256,
                                 expert_cache=expert_cache, **fields))
    engine.load()
    return engine


def slot_problems(engine) -> list[str]:
    """What disagrees between the device table, the cache's mirror and the slots' bytes."""
    import torch

    torch.cuda.synchronize()
    store = engine.memory.experts
    mirror = store.table_mirror
    problems = []
    device_table = store.table.cpu()
    if not torch.equal(device_table, store.local_table(mirror)):
        problems.append("device table != mirror at "
                        f"{(device_table != store.local_table(mirror)).nonzero()[:4].tolist()}")
    named = {(layer, expert, int(mirror[layer, expert])) for layer in store.layer_ids
             for expert in range(store.num_experts) if mirror[layer, expert] >= 0}
    if named != set(store.cache.resident()):
        problems.append(f"mirror and cache differ: {sorted(named ^ set(store.cache.resident()))[:4]}")
    differing = store.verify_slots()  # every resident slot against its host copy
    if differing:
        problems.append(f"{differing} resident slots differ from the host copy")
    return problems


def _runs(engine, greedy, check: bool) -> list[list[int]]:
    from strata.engine.protocol import SamplingSpec
    from tests.gpu.test_quant_experts_cuda import PROMPT

    def one() -> list[int]:
        if not check:
            return greedy(engine)
        tokens: list[int] = []
        for step in engine.generate(PROMPT, SamplingSpec(max_tokens=24, temperature=0.0)):
            tokens += step
            for problem in slot_problems(engine)[:4]:
                print(f"  after token {len(tokens) - 1}: {problem}", flush=True)
        return tokens

    runs = [one()]
    if engine.memory.experts.is_all_resident:
        return runs
    engine.release_experts()
    engine.refill_experts()
    runs.append(one())
    engine.resize_experts(SHRUNK_SLOTS)
    runs.append(one())
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--check-slots", action="store_true")
    args = parser.parse_args()
    from tests.gpu.test_quant_experts_cuda import MIXED, _gguf, _greedy

    path = _gguf(Path(tempfile.mkdtemp()), "qwen3_moe", "Q8_0", MIXED)
    reference = _engine(path, False, "24")
    expected = _greedy(reference)
    reference.close()
    print("reference", expected, flush=True)
    for mode in args.modes:
        env, fields, expert_cache = MODES[mode]
        os.environ.update(env)
        engine = _engine(path, True, expert_cache, **fields)
        try:
            runs = _runs(engine, _greedy, args.check_slots and mode == "default")
        finally:
            engine.close()
            for name in env:
                os.environ.pop(name)
        for i, tokens in enumerate(runs):
            part = next((j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
            print(f"{mode} run {i}: first differing token {part}", flush=True)


if __name__ == "__main__":
    main()
