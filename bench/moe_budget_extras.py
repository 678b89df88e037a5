"""moe_budget_bench.py's two rows after the budgets' routing rows: a decode profile per
budget under the zipf trace (`--profile-steps`), and a shrink while a stream decodes
(`--shrink-pause`, issue 54's "no token lost, no pause longer than 100 ms")."""

from __future__ import annotations

import statistics
import time
from itertools import pairwise

from batch_bench import prompt, sync

# Kernel names of host->device copies in torch.profiler's CUDA events (the pinned host copy
# into slots or staging); the rest are kernels, which read resident experts and, for a miss
# left on the host, the host copy in place.
HTOD_MARKS = ("HtoD", "memcpy_htod")  # "Memcpy HtoD (Pinned -> Device)" in run 36


def profile_row(engine, forced, num_tokens: int, top: int = 12) -> dict:
    """quant_bench.decode_profile under `forced` routing (attached for the profile), plus the
    share of the profiled GPU time in host->device copies. On the CPU the profiler lists no
    CUDA events: the table is empty and the shares are None."""
    from quant_bench import decode_profile

    forced.attach(engine.model, engine.fast)
    try:
        profile = decode_profile(engine, num_tokens, top)
    finally:
        forced.detach()
    kernels = profile["kernels"]
    busy_us = sum(k["exclusive_us_per_token"] for k in kernels)
    htod_us = sum(k["exclusive_us_per_token"] for k in kernels
                  if any(mark in k["name"] for mark in HTOD_MARKS))
    profile["htod_us_per_token"] = htod_us
    profile["htod_share"] = htod_us / busy_us if busy_us else None
    profile["kernel_share"] = (busy_us - htod_us) / busy_us if busy_us else None
    return profile


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
    return {"tokens_asked": num_tokens, "tokens_received": len(tokens),
            "from_slots": max_slots, "to_slots": target_slots,
            "slots_after": engine.memory.experts.num_slots,
            "resize_s": resize_s, "resize": resized if resize_s is not None else None,
            "max_gap_ms": max(gaps_ms) if gaps_ms else None,
            "shrink_gap_ms": (gaps_ms[shrink_gap - 1]
                              if shrink_gap is not None and shrink_gap - 1 < len(gaps_ms)
                              else None),
            "median_gap_ms": statistics.median(gaps_ms) if gaps_ms else None,
            "tokens_equal_unshrunk": tokens == reference}
