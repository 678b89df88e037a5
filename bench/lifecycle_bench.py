"""Lifecycle benchmark: the engine's memory levels on a real-sized random model.

    python bench/lifecycle_bench.py --json out.json --model qwen3-30b-a3b-mini|llama3-8b

Loads seeded random weights into the engine's arenas (qwen3-30b-a3b-mini is Qwen3-30B-A3B with
14 of its 48 layers: 15.75 GiB of experts), then times release/refill of the experts, offload
and restore of a 32k-token session, a slot switch, sleep/wake, and greedy decode before the
release and after the refill; then, in a second engine, decode with 25% of the experts cached
and the cache's hit rate. Each figure is compared with the pinned copy bandwidth measured
here. The session's KV is filled synthetically: its bytes are what is moved, and a 32k prefill
is not what this measures. Prints a table and writes JSON (DESIGN §8 targets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # arena_bench.py next to this file
from arena_bench import hardware_and_versions
from limits import pinned_bandwidth_gb_s
from report import figure, format_figures, write_json  # bench/report.py, next to this file

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.memory.backend import cuda_available
from strata.engine.core.memory.vram import read_free_vram_bytes
from strata.engine.core.random_weights import PRESETS
from strata.engine.protocol import SamplingSpec
from strata.units import GIB

MODELS = {
    "qwen3-30b-a3b-mini": {**PRESETS["qwen3-30b-a3b"], "num_hidden_layers": 14},
    "llama3-8b": PRESETS["llama3-8b"],
}
SESSION_TOKENS = 32768
RELEASE_TARGET_MS_PER_16_GIB = 20.0
COPY_TARGET_RATIO = 0.85  # refill experts, wake weights
SESSION_TARGET_RATIO = 0.80  # offload / restore session


def _timed(fn) -> tuple[object, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def decode_tok_s(engine: Engine, num_tokens: int, slot: int) -> float:
    """Greedy decode rate after the first token (which carries the prefill)."""
    spec = SamplingSpec(max_tokens=num_tokens, temperature=0.0)
    steps = engine.generate(list(range(1, 33)), spec, slot=slot)
    next(steps)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    count = sum(len(ids) for ids in steps)
    return count / (time.perf_counter() - t0)


def long_prompt_ttft_ms(engine: Engine, num_tokens: int, slot: int) -> tuple[float, float]:
    """Time to first token for a long prompt read cold, then for the same conversation plus a
    short turn after its session was offloaded (restored from RAM, only the new turn prefilled)."""
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    span = min(engine.model_config.vocab_size, 1000) - 1
    prompt = [(i * 7919) % span + 1 for i in range(num_tokens)]

    def ttft_ms(ids: list[int]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in engine.generate(ids, spec, slot=slot):
            break
        return (time.perf_counter() - t0) * 1e3

    engine.erase_slot(slot)
    cold = ttft_ms(prompt)
    engine.offload_session()
    restored = ttft_ms(prompt + list(range(2, 10)))
    assert engine.last_usage is None or engine.last_usage.cached_tokens >= num_tokens - 1
    return cold, restored


def expert_cache_decode(config_path: Path, device: str, fraction: float,
                        decode_tokens: int) -> dict:
    """Greedy decode with only `fraction` of the experts in VRAM slots (the rest read in
    place from the pinned host copy, and promoted into slots between steps), and the cache's
    hit rate over the timed tokens.

    With random weights the router keeps picking the same few experts (an H200 run measured a
    hit rate of 1.00), so this row shows the graph path and the cache's bookkeeping, not what
    a miss costs."""
    config = json.loads(config_path.read_text())
    slots = max(1, round(fraction * config["num_hidden_layers"] * config["num_experts"]))
    engine = Engine(EngineConfig(
        model_path="random:expert-cache", random_weights=str(config_path), device=device,
        context_tokens=1024, expert_cache=str(slots)))
    engine.load()
    try:
        decode_tok_s(engine, decode_tokens, 0)  # warm-up, as for the resident row
        before = engine.memory.experts.cache.stats()
        tok_s = decode_tok_s(engine, decode_tokens, 0)
        after = engine.memory.experts.cache.stats()
    finally:
        engine.close()
    hits = after["num_hits"] - before["num_hits"]
    lookups = hits + after["num_misses"] - before["num_misses"]
    return {"slots": slots, "tok_s": tok_s, "hit_rate": hits / lookups if lookups else None,
            "evictions": after["num_evictions"] - before["num_evictions"]}


def fill_session(engine: Engine, slot: int, num_tokens: int) -> int:
    """A resident slot holding num_tokens of (synthetic) history; returns its KV bytes."""
    state = engine.slots.checkout(slot)
    try:
        state.kv.ensure_tokens(num_tokens)
        for t in (*state.kv.k, *state.kv.v):
            t[:num_tokens].normal_()
        state.tokens[:] = [(i * 7919) % 1000 + 1 for i in range(num_tokens)]
    finally:
        engine.slots.checkin(slot)
    return num_tokens * 2 * len(state.kv.k) * state.kv.k[0][0].nbytes


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)  # the engine's device
    h2d, d2h = pinned_bandwidth_gb_s(device, GIB, 5)
    workdir = Path(tempfile.mkdtemp(prefix="lifecycle-bench-"))
    config_path = workdir / "config.json"
    config_path.write_text(json.dumps(MODELS[args.model]))
    engine = Engine(EngineConfig(
        model_path=f"random:{args.model}", random_weights=str(config_path), device="cuda",
        context_tokens=SESSION_TOKENS + 256, expert_cache="all",
        snapshot_dir=str(workdir / "snapshots"), snapshot_ram_budget_bytes=32 * GIB,
    ))
    _, load_s = _timed(engine.load)
    is_moe = engine.memory.experts is not None
    figures: list[dict] = []
    raw: dict = {"load_s": load_s, "arenas_after_load": engine.status()["arenas"]}

    def add(name: str, value: float | None, unit: str, limit: float | None = None,
            target: float | None = None) -> None:
        # ratio = value / limit everywhere (as in arena_bench): <= 1 is good for times.
        figures.append(figure(name, value, unit, limit, target, higher_is_better=unit != "ms"))

    add("load (random weights)", load_s, "s")
    # The first decode captures the CUDA graphs and compiles kernels: run it once unmeasured.
    decode_tok_s(engine, args.decode_tokens, 0)
    add("decode before release", decode_tok_s(engine, args.decode_tokens, 0), "tok/s")

    if is_moe:
        store = engine.memory.experts
        expert_bytes = store.arena.resident_bytes
        release_ms, refill_gb_s, nvml_freed = [], [], []
        for _ in range(args.cycles):
            free_before = read_free_vram_bytes(0)
            _, seconds = _timed(engine.release_experts)
            release_ms.append(seconds * 1e3)
            free_after = read_free_vram_bytes(0)
            if free_before is not None and free_after is not None:
                nvml_freed.append(free_after - free_before)
            refill, seconds = _timed(engine.refill_experts)
            refill_gb_s.append(refill["copied_bytes"] / seconds / 1e9)
        raw |= {"release_ms": release_ms, "refill_gb_s": refill_gb_s, "nvml_freed": nvml_freed}
        target_ms = RELEASE_TARGET_MS_PER_16_GIB * expert_bytes / (16 * GIB)
        add(f"release experts ({expert_bytes / GIB:.2f} GiB)", statistics.median(release_ms),
            "ms", target_ms, 1.0)
        add("refill experts incl. mapping", statistics.median(refill_gb_s), "GB/s", h2d,
            COPY_TARGET_RATIO)
        # Slot 0 again: a new slot has other KV addresses, so its first decode would capture new
        # CUDA graphs inside the timed loop (the first run's 479-vs-767 tok/s came from that).
        add("decode after refill", decode_tok_s(engine, args.decode_tokens, 0), "tok/s")
        raw["differing_slots"] = store.verify_slots()

    kv_bytes = fill_session(engine, 2, SESSION_TOKENS)
    # The first offload allocates and pins the snapshot pool's memory; a server pays that once.
    _, seconds = _timed(engine.offload_session)
    add("first offload (allocates + pins the pool)", seconds * 1e3, "ms")
    engine.restore_session()
    offload, seconds = _timed(engine.offload_session)
    add(f"offload session ({SESSION_TOKENS} tok, {kv_bytes / GIB:.2f} GiB)",
        offload["snapshot_bytes"] / seconds / 1e9, "GB/s", d2h, SESSION_TARGET_RATIO)
    restore, seconds = _timed(engine.restore_session)
    add("restore session", kv_bytes / seconds / 1e9, "GB/s", h2d, SESSION_TARGET_RATIO)
    engine.slots.offload(2)  # slot 2 waits in RAM; switching to it restores it
    _, switch_s = _timed(lambda: (engine.slots.checkout(2), engine.slots.checkin(2)))
    switch_target_ms = 1.5 * kv_bytes / (h2d * 1e9) * 1e3 + 10
    add(f"slot switch ({SESSION_TOKENS} tokens from RAM)", switch_s * 1e3, "ms", switch_target_ms,
        1.0)
    cold_ms, restored_ms = long_prompt_ttft_ms(engine, SESSION_TOKENS - 64, slot=3)
    add(f"TTFT cold, {SESSION_TOKENS - 64}-token prompt", cold_ms, "ms")
    add("TTFT after offload, same prompt + 8 tokens", restored_ms, "ms", cold_ms)

    resident = sum(a.resident_bytes for a in engine.memory.arenas)
    free_before = read_free_vram_bytes(0)
    slept, sleep_s = _timed(engine.sleep)
    free_after = read_free_vram_bytes(0)
    add(f"sleep ({slept['freed_bytes'] / GIB:.2f} GiB freed)", sleep_s * 1e3, "ms")
    woken, wake_s = _timed(engine.wake)
    add(f"wake ({woken['copied_bytes'] / GIB:.2f} GiB copied)",
        woken["copied_bytes"] / wake_s / 1e9, "GB/s", h2d, COPY_TARGET_RATIO)
    add("decode after wake", decode_tok_s(engine, args.decode_tokens, 0), "tok/s")
    raw |= {"resident_before_sleep": resident, "sleep": slept, "wake": woken,
            "nvml_freed_by_sleep": None if free_before is None or free_after is None
            else free_after - free_before, "restore": restore}
    engine.close()

    if is_moe and args.expert_cache_fraction > 0:
        # A partial cache: what a GPU too small for all the experts gets (issue: speed).
        cached = expert_cache_decode(config_path, "cuda", args.expert_cache_fraction,
                                     args.decode_tokens)
        resident_tok_s = next(f["value"] for f in figures if f["figure"] == "decode after wake")
        add(f"decode, {args.expert_cache_fraction:.0%} of experts cached ({cached['slots']} "
            "slots)", cached["tok_s"], "tok/s", resident_tok_s)
        add("expert cache hit rate over those tokens", cached["hit_rate"], "")
        raw["expert_cache"] = cached

    return {
        "benchmark": "lifecycle",
        "command": " ".join(sys.argv),
        "hardware": hardware_and_versions(device),
        "params": {"model": args.model, "session_tokens": SESSION_TOKENS,
                   "cycles": args.cycles, "decode_tokens": args.decode_tokens,
                   "pinned_h2d_gb_s": h2d, "pinned_d2h_gb_s": d2h},
        "figures": figures,
        "targets": {"copy_ratio": COPY_TARGET_RATIO, "session_ratio": SESSION_TARGET_RATIO,
                    "release_ms_per_16_gib": RELEASE_TARGET_MS_PER_16_GIB},
        "raw": raw,
    }


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"{hw['gpu']} | driver {hw['driver']} | torch {hw['torch']} (CUDA {hw['torch_cuda']})")
    print(f"model {report['params']['model']}: pinned H2D "
          f"{report['params']['pinned_h2d_gb_s']:.1f} GB/s, D2H "
          f"{report['params']['pinned_d2h_gb_s']:.1f} GB/s")
    print(format_figures(report["figures"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b-mini")
    parser.add_argument("--cycles", type=int, default=3, help="release/refill cycles")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--expert-cache-fraction", type=float, default=0.25,
                        help="also decode with this fraction of the experts cached (0: skip)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if not cuda_available():
        print("lifecycle_bench: no usable CUDA GPU or driver here; run it where an NVIDIA GPU "
              "is present", file=sys.stderr)
        return 2
    report = run(args)
    print_table(report)
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
