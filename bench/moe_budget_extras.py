"""moe_budget_bench.py's rows beside the budgets' routing rows: a decode profile per budget
under a trace (`--profile-steps`), a prefill profile (`--profile-prefill`), a shrink while
a stream decodes (`--shrink-pause`, issue 54's "no token lost, no pause longer than 100
ms"), and the same shrink from every expert resident (`--shrink-from-all`: the live switch
to the partial cache)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from itertools import pairwise

from batch_bench import prompt, sync


@contextmanager
def forced_on(engine, forced):
    """`forced` routing attached to the engine's model for the block, detached after it."""
    forced.attach(engine.model, engine.fast)
    try:
        yield
    finally:
        forced.detach()


def profile_row(engine, forced, num_tokens: int, warmup_tokens: int, top: int = 12) -> dict:
    """quant_bench.decode_profile under `forced` routing (attached for the profile; the cache
    settles on it over warmup_tokens first, as the decode rows do), plus the share of the
    profiled GPU time in host->device copies. On the CPU the profiler lists no
    CUDA events: the table is empty and the share is None."""
    from quant_bench import decode_profile

    with forced_on(engine, forced):
        profile = decode_profile(engine, num_tokens, top, warmup_tokens)
    busy_us, htod_us = profile["busy_us_per_token"], profile["htod_us_per_token"]
    profile["htod_share"] = htod_us / busy_us if busy_us else None
    return profile


def resize_settled(engine, num_slots: int) -> dict:
    """engine.resize_experts(num_slots), then the idle work the engine process runs once no
    command has come for 0.25 s (process.py): a grown cache's fill of its new slots
    (ExpertPromotion.fill). The resize's result, with the idle work's seconds and steps."""
    resized = engine.resize_experts(num_slots)
    started = time.perf_counter()
    steps = engine.run_deferred_work()
    sync()
    resized.update(idle_work_s=time.perf_counter() - started, idle_work_steps=len(steps))
    return resized


def prefill_profile_row(engine, forced, num_tokens: int, top: int = 12) -> dict:
    """quant_bench.prefill_profile under `forced`'s prefill trace (set by the caller,
    attached for the profile): both walls, the GPU's busy time, the staging's copies from
    the host copy and its gathers from slots (bytes over both prompts), the top kernels.
    Busy well below the wall means the host or a wait set the prefill's time, not the
    GPU's work."""
    from quant_bench import prefill_profile

    def staging() -> tuple[int, int]:
        experts = engine.status()["experts"]
        return experts["staged_bytes"], experts["gathered_bytes"]

    staged, gathered = staging()
    with forced_on(engine, forced):
        profile = prefill_profile(engine, num_tokens, top)
    staged_after, gathered_after = staging()
    profile.update(staged_bytes_two_prompts=staged_after - staged,
                   gathered_bytes_two_prompts=gathered_after - gathered)
    return profile


def print_prefill_profile(label: str, profile: dict) -> None:
    """One line of a prefill profile (prefill_profile_row)."""
    top = ", ".join(f"{k['name'][:40]} {k['exclusive_us'] / 1e3:.1f}"
                    for k in profile["kernels"][:5])
    print(f"{label} prefill {profile['tokens']} profile: "
          f"{profile['wall_unprofiled_us'] / 1e3:.0f} ms ({profile['wall_us'] / 1e3:.0f} "
          f"profiled), GPU busy {profile['busy_us'] / 1e3:.0f} ms, host->device "
          f"{profile['htod_us'] / 1e3:.0f} ms, device->device {profile['dtod_us'] / 1e3:.0f} "
          f"ms, staged from host {profile['staged_bytes_two_prompts'] / 2**30:.2f} GiB in two "
          f"prompts; top: {top}", flush=True)


def print_profile(label: str, profile: dict) -> None:
    """One line of a decode profile: the token's time unprofiled and profiled, the copies'
    share of the GPU's busy time, the top kernels' exclusive microseconds a token."""
    top = ", ".join(f"{k['name'][:40]} {k['exclusive_us_per_token']:.0f}"
                    for k in profile["kernels"][:5])
    share = profile["htod_share"]
    print(f"{label} decode profile: {profile['wall_unprofiled_us_per_token']:.0f} us a token "
          f"({profile['wall_us_per_token']:.0f} profiled, GPU busy "
          f"{profile['busy_us_per_token']:.0f}), host->device copies "
          f"{'n/a' if share is None else f'{share:.0%}'} of GPU time; top: {top}", flush=True)


def shrink_pause_row(engine, max_slots: int, target_slots: int, num_tokens: int,
                     shrink_after: int) -> dict:
    """A greedy stream of num_tokens with the model's own routes: first unshrunk at max_slots
    (the reference tokens), then again from max_slots with engine.resize_experts(target_slots)
    called between two yielded tokens after shrink_after of them, as the engine process runs
    a command between steps. Every token's arrival is timed."""
    from strata.engine.protocol import SamplingSpec

    spec = SamplingSpec(max_tokens=num_tokens, temperature=0.0)
    ids = prompt(engine.model_config.vocab_size, 7, 32)
    engine.resize_experts(max_slots)
    # Twice unshrunk: the first run leaves the prompt cached in the slot, so the reference
    # and the timed stream both start from the cached prefix (a prompt prefilled fresh and
    # one taken from the cache round differently in bf16: run 36's tokens parted there).
    for _ in range(2):
        reference = [t for step in engine.generate(ids, spec, slot=0) for t in step]
    engine.resize_experts(max_slots)  # the shrink starts from the same residency
    tokens: list[int] = []
    arrivals_s: list[float] = []
    resize_s = None
    shrink_gap = None
    for step in engine.generate(ids, spec, slot=0):
        sync()
        now = time.perf_counter()
        tokens.extend(step)
        arrivals_s.extend([now] * len(step))
        if resize_s is None and len(tokens) >= shrink_after:
            started_s = time.perf_counter()
            resized = engine.resize_experts(target_slots)
            resize_s = time.perf_counter() - started_s
            shrink_gap = len(tokens)  # the gap after this token holds the shrink
    gaps_ms = [(b - a) * 1e3 for a, b in pairwise(arrivals_s)]
    parted = first_difference(tokens, reference)
    return {"tokens_asked": num_tokens, "tokens_received": len(tokens),
            "from_slots": max_slots, "to_slots": target_slots,
            "slots_after": engine.memory.experts.num_slots,
            "resize_s": resize_s, "resize": resized if resize_s is not None else None,
            "max_gap_ms": max(gaps_ms) if gaps_ms else None,
            "shrink_gap_ms": (gaps_ms[shrink_gap - 1]
                              if shrink_gap is not None and shrink_gap - 1 < len(gaps_ms)
                              else None),
            "median_gap_ms": statistics.median(gaps_ms) if gaps_ms else None,
            "tokens_equal_unshrunk": tokens == reference,
            # Where they part (None: they do not), and each side's tokens from there.
            "first_difference": parted,
            "tokens_from_difference": None if parted is None else {
                "shrunk": tokens[parted : parted + 8], "unshrunk": reference[parted : parted + 8]}}


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    """The index of the first token where the two streams differ (a shorter one differs
    where it ends), or None when they are equal."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def print_shrink(row: dict) -> None:
    print(f"shrink {row['from_slots']} -> {row['to_slots']} slots ({row['to_label']}) while "
          f"decoding: {row['tokens_received']} of {row['tokens_asked']} tokens, largest "
          f"gap {row['max_gap_ms']:.1f} ms, the shrink's gap {row['shrink_gap_ms']:.1f} ms, "
          f"median {row['median_gap_ms']:.1f} ms, resize {row['resize_s']:.3f} s, tokens "
          f"equal the unshrunk run: {row['tokens_equal_unshrunk']}"
          + (f" (from token {row['first_difference']}: {row['tokens_from_difference']})"
             if not row["tokens_equal_unshrunk"] else ""), flush=True)


def shrink_from_all(args, shape, report: dict) -> None:
    """--shrink-from-all: issue 54's starting point, every expert resident (wired into the
    model at load), then the shrink to --shrink-to between two tokens of a stream: the live
    switch to the partial cache (ModelMemory.switch_to_slots) and its first graph capture."""
    from moe_budget_bench import budget_slots, decode_row, plan_budget, prefill_row
    from report import write_json

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.units import MIB

    context = args.prefill_tokens + args.shrink_tokens + 64
    engine = Engine(EngineConfig(model_path=str(args.gguf), device=args.device, num_slots=1,
                                 context_tokens=context, expert_cache="all"))
    try:
        started_s = time.perf_counter()
        info = engine.load()
        report["load"] = {"seconds": time.perf_counter() - started_s, "info": info}
        # What the engine process runs once idle after a load (process.py): among it the
        # slot-table kernels' compile (GraphDecoder.warm_expert_cache) a live switch needs.
        started_s = time.perf_counter()
        report["deferred_work"] = {"steps": engine.run_deferred_work(),
                                   "seconds": time.perf_counter() - started_s}
        store = engine.memory.experts
        if store is None or engine.memory.expert_mode != "all":
            raise SystemExit(f"the experts did not all load resident "
                             f"({engine.memory.expert_mode})")
        non_expert = None
        if args.device == "cuda":  # as strata_rows sizes its budgets
            from quant_bench import vram_used_bytes

            decode_row(engine, 4, 0)
            prefill_row(engine, args.prefill_tokens, "sizing", warm_up=True)
            held, _ = vram_used_bytes()
            non_expert = held - store.arena.resident_bytes
            report["non_expert_vram_bytes"] = non_expert
        target = plan_budget(shape, args.shrink_to, args.reserve_mib * MIB)
        row = shrink_pause_row(engine, store.max_slots,
                               budget_slots(args, store, target, non_expert),
                               args.shrink_tokens, args.shrink_after)
        row |= {"to_label": target.label, "from_all_resident": True,
                "mode_after": engine.memory.expert_mode}
        report["shrink_pause"] = row
        print_shrink(row)
        write_json(report, args.json)
    finally:
        engine.close()
        sync()
