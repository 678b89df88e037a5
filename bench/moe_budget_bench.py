"""A MoE GGUF under VRAM budgets with realistic routing: Strata's expert cache against
llama.cpp's experts on the CPU (issue 54's first deliverable).

    python bench/moe_budget_bench.py FILE.gguf [--budgets 8GiB 12GiB 16GiB]
        [--routings zipf uniform model] [--zipf-s 1.0] [--p-reuse 0.3] [--seed 0]
        [--decode-tokens 128] [--warmup-tokens 256] [--prefill-tokens 4096]
        [--reserve-mib 2048] [--llama-bench PATH] [--json OUT] [--deadline-s 480]
        [--cpu-misses off|on|auto] [--cpu-threads N] [--cpu-miss-graphs]
        [--cpu-cache-gib 4] [--cpu-preconvert] [--cpu-max-per-layer N] [--cpu-share F|auto]
        [--prefetch N] [--prefetch-recall A]

Budget arithmetic, the same for both engines: of a budget B, the experts may hold
    expert_bytes(B) = B - dense - reserve
where dense is the file's non-expert tensor bytes and reserve (--reserve-mib, default 2 GiB:
the engine's --expert-cache auto reserve, EXPERT_RESERVE_BYTES) covers the KV cache at the
context, activations, scratch and the CUDA graphs. Strata gets
    slots = expert_bytes(B) // (file's expert bytes / (MoE layers * experts))
(the same division the engine's --vram-budget with --expert-cache auto makes); llama.cpp
keeps the experts of the first N layers on the CPU (`-ncmoe N`), N the fewest layers whose
removal leaves the GPU's expert layers within expert_bytes(B). Strata loads once with the
largest budget's slots and resizes the cache (Engine.resize_experts) for each budget, in the
order given (the first rows first, should --deadline-s cut the run).

Routing, per budget: "zipf" (skewed popularity and reuse of the last token's experts) and
"uniform" (the worst case) are imposed on every MoE layer from a trace (routing_trace.py,
models/forced_routing.py); "model" is the random weights' own routes (nearly the same
experts every token: the all-hits reference). llama.cpp runs its own routes: with its
experts on the CPU every token reads them from RAM whichever they are, so its rows do not
depend on the routing.

Per row: decode tok/s over --decode-tokens after --warmup-tokens (batch 1, greedy, the
server's CUDA graphs; the warm-up lets the cache settle on the trace's popularity after the
resize, as it has in a session that has run for a while: a cold cache copies ~50 experts a
token for its first ~100, tests/memory/test_expert_policy.py), prefill tok/s of a fresh
--prefill-tokens prompt (the load's first row prefills one more before, unmeasured: it
compiles), the expert cache's hit rate over the
decode, and the bytes moved from host to device per decoded token (copies into slots plus
experts read in place from the pinned host copy), split into the two, with the fraction of
misses the cache's admission left on the host, the copy calls a token and the rate the
promotion copies ran at (device events); per layer in the JSON. Per prefill: the bytes its
layers staged from the host copy and gathered from slots, its staging copy calls, and the
staging area's size (memory/expert_staging.py). On a GPU Strata's slots per
budget come from the VRAM the process holds beside them (measured after a decode and a long
prompt) and the chunks the slot arena keeps mapped (ExpertStore.slots_within).
--cpu-misses on|auto loads Strata with cpu_expert_misses so (fast/moe_cpu_misses.py: one
token's misses computed on the CPU while the GPU computes the hits; decode steps called, not
replayed from graphs); each row then also has the misses computed on the CPU per token, the
CPU forms converted during the timed decode and the bytes they hold; --cpu-miss-graphs
replays the step cut at each MoE layer as CUDA graphs instead (fast/split_runner.py,
STRATA_CPU_MISS_GRAPHS=1); --cpu-preconvert makes the CPU forms of the experts with no slot
after each resize, up to --cpu-cache-gib (EngineConfig.cpu_expert_cache_bytes), so "on" is
timed without its first conversions; --cpu-max-per-layer N sends at most N of a layer's
misses a token to the CPU and reads the others in place meanwhile (CpuMisses.max_per_layer:
the CPU's threads and the link at once); --cpu-share F sends that fraction of them, rounded
up (CpuMisses.share); --cpu-share auto starts each layer at half and moves it a step a token
toward the side that finished first (CpuMisses.balance, fast/cpu_share.py); --prefetch N
guesses N of the next MoE layer's experts at each layer's split and copies the missing ones
in meanwhile (fast/moe_prefetch.py; the row's "prefetch" has the guess's recall and the
copies that were hits, late or unused): by the next router on this layer's x, or, with
--prefetch-recall A, from the forced trace at recall A (a forced trace leaves the router
nothing to predict, and a random model's routes say nothing of a trained one's: this
measures what a guess of a given recall buys). With --cpu-misses each row also has
`split_host_ms_per_token`: the split step's waits for the GPU and the CPU and its own host
work, summed over the MoE layers (where run 40's ~0.45 ms a layer went was not measured).
Run the bench once per mode on one machine to compare on, off and llama.cpp.
llama-bench runs first, per budget on the same file (its rows are bounded; without them no
row has a ratio); ratios are Strata / llama.cpp. A table on stdout and JSON (hardware,
versions, figure, limit, ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # the checkout, for strata
sys.path.insert(0, str(BENCH_DIR))

from strata.engine.core.process import use_engine_allocator

# Before torch is imported: the VRAM rows measure the allocator the server's engine runs.
use_engine_allocator()

import moe_budget_bench_args
from batch_bench import first_token_s, prompt, sync, take
from moe_budget_llamacpp import llamacpp_rows
from report import figure, format_figures, write_json
from routing_trace import TraceSpec, make_trace, reuse_fraction

from strata.engine.core.fast.moe_cpu_misses import HOST_TIMES  # after the allocator is set
from strata.units import GIB, MIB

DECODE_TARGETS = {"zipf": 1.5, "uniform": 1.0}  # Strata / llama.cpp, issue 54 at 12 GiB
PREFILL_TARGET = 1.0
@dataclass(frozen=True)
class FileShape:
    """What the budget arithmetic reads of the GGUF: bytes as stored, per MoE layer."""

    num_layers: int
    num_experts: int
    top_k: int
    dense_bytes: int
    layer_expert_bytes: dict[int, int]  # MoE layer -> its experts' bytes (gate+up+down)

    @property
    def expert_bytes(self) -> int:
        return sum(self.layer_expert_bytes.values())

    @property
    def bytes_per_expert(self) -> int:
        return self.expert_bytes // (len(self.layer_expert_bytes) * self.num_experts)

    @property
    def total_experts(self) -> int:
        return len(self.layer_expert_bytes) * self.num_experts


def file_shape(path: Path) -> FileShape:
    """The file's MoE shape and its dense and per-layer expert bytes."""
    from strata.engine.gguf_file import open_gguf

    reader = open_gguf(path)
    arch = reader.metadata.get("general.architecture")
    num_experts = int(reader.metadata.get(f"{arch}.expert_count") or 0)
    if not num_experts:
        raise SystemExit(f"{path} is not a MoE file ({arch}.expert_count is not set)")
    layer_bytes: dict[int, int] = {}
    dense = 0
    for tensor in reader.tensors:
        match = re.match(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.", tensor.name)
        if match:
            layer = int(match.group(1))
            layer_bytes[layer] = layer_bytes.get(layer, 0) + tensor.n_bytes
        else:
            dense += tensor.n_bytes
    return FileShape(int(reader.metadata[f"{arch}.block_count"]), num_experts,
                     int(reader.metadata[f"{arch}.expert_used_count"]), dense, layer_bytes)


@dataclass(frozen=True)
class BudgetPlan:
    """One budget's share for the experts, as Strata slots and llama.cpp's -ncmoe."""

    budget_bytes: int
    expert_bytes: int  # budget - dense - reserve (>= 0)
    slots: int  # Strata's expert cache
    ncmoe: int  # llama.cpp: layers whose experts stay on the CPU
    gpu_expert_layer_bytes: int  # what llama.cpp's GPU expert layers hold
    # Every expert fits (llama.cpp -ncmoe 0): an engine at this budget wires them all, so
    # the row (at most all slots but one) is the cache's path, not what a user runs there.
    fits: bool

    @property
    def label(self) -> str:
        gib = self.budget_bytes / GIB
        return f"{gib:g}GiB" if gib >= 1 else f"{self.budget_bytes / MIB:g}MiB"


def plan_budget(shape: FileShape, budget_bytes: int, reserve_bytes: int) -> BudgetPlan:
    """Split a budget: expert bytes, Strata's slots (at least one layer's experts, at most
    all but one: the cache stays a cache so one load serves every budget) and the fewest
    CPU layers for llama.cpp whose GPU expert layers fit the same bytes."""
    expert_bytes = max(budget_bytes - shape.dense_bytes - reserve_bytes, 0)
    slots = expert_bytes // shape.bytes_per_expert
    slots = max(min(slots, shape.total_experts - 1), shape.num_experts)
    # -ncmoe N puts the experts of layers 0..N-1 on the CPU: the GPU keeps the later ones.
    for ncmoe in range(shape.num_layers + 1):
        on_gpu = sum(nbytes for layer, nbytes in shape.layer_expert_bytes.items()
                     if layer >= ncmoe)
        if on_gpu <= expert_bytes:
            break
    return BudgetPlan(budget_bytes, expert_bytes, slots, ncmoe, on_gpu,
                      expert_bytes >= shape.expert_bytes)


CPU_COUNTERS = ("num_cpu_conversions", "cpu_convert_s", "num_cpu_split_layers",
                "num_cpu_overlapped_layers", *HOST_TIMES)  # with --cpu-misses on or auto


def expert_counters(status: dict) -> dict:
    """The expert cache's running totals, of one ExpertStore.status()."""
    return {key: status[key] for key in ("num_hits", "num_misses", "num_left_out",
                                         "num_evictions", "copied_bytes", "host_read_bytes",
                                         "num_copy_calls", "timed_copy_bytes",
                                         "copy_seconds", "num_cpu_experts", *CPU_COUNTERS)
            if key in status}


def layer_counters(status: dict) -> dict[int, dict]:
    """Per MoE layer of one ExpertStore.status(): hits, misses, misses left on the host,
    bytes copied and read in place."""
    return {row["layer"]: {k: v for k, v in row.items() if k != "layer"}
            for row in status["layers"]}


def decode_row(engine, num_tokens: int, warmup_tokens: int) -> dict:
    """Greedy decode of num_tokens after the first (which carries a short prompt's prefill)
    and warmup_tokens more; tok/s, hit rate and bytes moved per token over the timed ones."""
    from strata.engine.protocol import SamplingSpec

    spec = SamplingSpec(max_tokens=1 + warmup_tokens + num_tokens, temperature=0.0)
    steps = engine.generate(prompt(engine.model_config.vocab_size, 5, 32), spec, slot=0)
    take(steps, 1 + warmup_tokens)
    sync()
    # One status read each side, outside the timed steps.
    status_before = engine.memory.experts.status()
    started_s = time.perf_counter()
    timed = sum(len(ids) for ids in steps)
    sync()
    seconds = time.perf_counter() - started_s
    status_after = engine.memory.experts.status()
    before, after = expert_counters(status_before), expert_counters(status_after)
    delta = {key: after[key] - before[key] for key in after}
    layers_before = layer_counters(status_before)
    layers = {layer: {k: v - layers_before[layer][k] for k, v in row.items()}
              for layer, row in layer_counters(status_after).items()}
    lookups = delta["num_hits"] + delta["num_misses"]
    return {"tokens": timed, "seconds": seconds, "decode_tok_s": timed / seconds,
            "hit_rate": delta["num_hits"] / lookups if lookups else None,
            "h2d_bytes_per_token": (delta["copied_bytes"] + delta["host_read_bytes"]) / timed,
            "copied_bytes_per_token": delta["copied_bytes"] / timed,
            "host_read_bytes_per_token": delta["host_read_bytes"] / timed,
            # Misses read in place and not copied in (the cache's admission), of all misses.
            "left_out_fraction": (delta["num_left_out"] / delta["num_misses"]
                                  if delta["num_misses"] else None),
            # The rate promotion copies ran at on the side stream (device events), not bytes
            # over decode time.
            "copy_gb_s": (delta["timed_copy_bytes"] / delta["copy_seconds"] / 1e9
                          if delta["copy_seconds"] > 0 else None),
            "copy_calls_per_token": delta["num_copy_calls"] / timed,
            # Misses computed on the CPU instead of read in place (--cpu-misses).
            "cpu_experts_per_token": delta["num_cpu_experts"] / timed,
            "cpu_conversions": delta.get("num_cpu_conversions"),
            # The split step's host time a token (ms): its waits for the GPU and the CPU,
            # and its own work (moe_cpu_misses.HOST_TIMES), summed over the MoE layers.
            "split_host_ms_per_token": {key[4:-2]: delta[key] * 1e3 / timed
                                        for key in HOST_TIMES if key in delta} or None,
            # --cpu-share auto: where the layers' balanced shares ended, on average.
            "cpu_share_mean": status_after.get("cpu_share_mean"),
            # --prefetch: its counters since the row started (its warm-up included).
            "prefetch": {key: status_after[key] for key in PREFETCH_KEYS
                         if key in status_after} or None,
            "counters": delta, "layers": layers}


PREFETCH_KEYS = ("num_prefetched", "prefetch_recall", "num_prefetch_hits", "num_prefetch_late",
                 "num_prefetch_unused")
PREFILL_COUNTERS = ("staged_bytes", "gathered_bytes", "num_staged_copy_calls", "copied_bytes",
                    "num_copy_calls", "num_evictions")


def prefill_row(engine, num_tokens: int, tag: str, warm_up: bool) -> dict:
    """A fresh prompt of num_tokens, after another when warm_up (the first prefill of a load
    compiles its kernels); tok/s of the last, prompt in to first token out, and what the
    last moved: bytes staged from the host copy and gathered from slots for its layers
    (memory/expert_staging.py), its staging copy calls, and any copies into slots."""
    vocab = engine.model_config.vocab_size
    store = engine.memory.experts
    runs_s = []
    for i in range(2 if warm_up else 1):
        before = store.status()
        runs_s.append(first_token_s(engine, f"prefill-{tag}-{i}",
                                    prompt(vocab, 100 + i, num_tokens), 0))
    after = store.status()
    moved = {f"prefill_{key}": after[key] - before[key] for key in PREFILL_COUNTERS}
    return {"prefill_tok_s": num_tokens / runs_s[-1], "runs_s": runs_s,
            "staging_bytes": after["staging_bytes"], **moved}


def strata_rows(args, shape: FileShape, plans: list[BudgetPlan], report: dict) -> None:
    """Load once with the largest budget's slots, then per budget (in the order given) resize
    the cache and measure each routing; results land in report["strata"][label][routing]."""
    import torch
    from moe_budget_extras import resize_settled

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.fast.tuning_store import device_identity
    from strata.engine.core.models.forced_routing import ForcedRouting, TraceGuess

    context = args.prefill_tokens + args.decode_tokens + args.warmup_tokens + 64
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)  # the CPU experts' intra-op threads
    if args.cpu_miss_graphs:
        os.environ["STRATA_CPU_MISS_GRAPHS"] = "1"  # read when the decoder is built
    engine = Engine(EngineConfig(model_path=str(args.gguf), device=args.device, num_slots=1,
                                 context_tokens=context,
                                 expert_cache=str(max(p.slots for p in plans)),
                                 cpu_expert_misses=args.cpu_misses,
                                 cpu_expert_cache_bytes=int(args.cpu_cache_gib * GIB)))
    report["cpu_expert_misses"] = args.cpu_misses
    report["cpu_max_per_layer"] = args.cpu_max_per_layer
    report["cpu_share"] = args.cpu_share
    report["prefetch"] = args.prefetch
    report["prefetch_recall"] = args.prefetch_recall  # None: the next router's guess
    report["cpu_threads"] = torch.get_num_threads()
    started_s = time.perf_counter()
    info = engine.load()
    report["load"] = {"seconds": time.perf_counter() - started_s, "info": info}
    if engine.memory.cpu_misses is not None:
        engine.memory.cpu_misses.max_per_layer = args.cpu_max_per_layer
        engine.memory.cpu_misses.balance = args.cpu_share == "auto"
        engine.memory.cpu_misses.share = None if args.cpu_share == "auto" else args.cpu_share
    # Whether decode with CPU misses replays split graphs (--cpu-miss-graphs) or is called.
    report["cpu_miss_graphs"] = bool(args.cpu_misses != "off" and engine.fast is not None
                                     and engine.fast.use_cuda_graphs)
    report["device"] = device_identity(engine.device)
    store = engine.memory.experts
    if store is None or engine.memory.expert_mode != "slots":
        raise SystemExit(f"the engine did not build an expert cache ({engine.memory.expert_mode})")
    store.cache.set_policy(args.policy)
    report["policy"] = args.policy
    arenas = engine.status().get("arenas", {})
    report["strata_arena_bytes"] = {name: row.get("resident_bytes")
                                    for name, row in arenas.items()}
    decode_len = args.warmup_tokens + args.decode_tokens + 64
    strata: dict = report.setdefault("strata", {})
    try:
        warm_up = True
        non_expert = None
        if args.device == "cuda":
            # Size each budget from what the process holds beside the slots once a decode
            # and a long prompt have run (CUDA context, weights, KV, torch's pools with the
            # graphs and the prefill's activations), not the file's dense bytes plus a
            # constant: run 33b held 0.81/1.31 GiB over 12/8 GiB that way.
            from quant_bench import vram_used_bytes

            decode_row(engine, 4, 0)
            prefill_row(engine, args.prefill_tokens, "sizing", warm_up=True)
            warm_up = False
            held, _ = vram_used_bytes()
            non_expert = held - store.arena.resident_bytes
            report["non_expert_vram_bytes"] = non_expert
        for plan in plans:
            slots = budget_slots(args, store, plan, non_expert)
            resized = resize_settled(engine, slots)
            rows: dict = strata.setdefault(plan.label, {
                "resize": resized, "slots": slots,
                "expert_mapped_bytes": store.arena.resident_bytes})
            if args.cpu_preconvert and engine.memory.cpu_misses is not None:
                started = time.perf_counter()
                cpu_misses = engine.memory.cpu_misses
                if cpu_misses.mode != "on":  # "on" converts every expert as it starts:
                    cpu_misses.preconvert()  # converting here too would race it, twice
                cpu_misses.wait_converted()
                rows["cpu_preconvert"] = {"experts": len(cpu_misses.cache),
                                          "seconds": time.perf_counter() - started}
            for routing in args.routings:
                if time.monotonic() > args.deadline:
                    rows[routing] = {"skipped": "deadline"}
                    continue
                forced = None
                if routing != "model":
                    spec = TraceSpec(routing, args.zipf_s, args.p_reuse, args.seed)
                    trace = make_trace(spec, decode_len, shape.num_layers, shape.num_experts,
                                       shape.top_k)
                    forced = ForcedRouting(trace, shape.num_experts, engine.device)
                    forced.attach(engine.model, engine.fast)
                if args.prefetch and engine.memory.cpu_misses is not None:  # counts anew
                    engine.memory.cpu_misses.start_prefetch(args.prefetch, TraceGuess(
                        forced, args.prefetch_recall) if forced is not None
                        and args.prefetch_recall is not None else None)
                try:
                    row = decode_row(engine, args.decode_tokens, args.warmup_tokens)
                    if forced is not None:
                        row["trace_reuse_fraction"] = reuse_fraction(trace)
                        spec = TraceSpec(routing, args.zipf_s, args.p_reuse, args.seed + 1)
                        forced.set_prefill(make_trace(spec, args.prefill_tokens,
                                                      shape.num_layers, shape.num_experts,
                                                      shape.top_k))
                    row |= prefill_row(engine, args.prefill_tokens, f"{plan.label}-{routing}",
                                       warm_up)
                    warm_up = False
                finally:
                    if forced is not None:
                        forced.detach()
                rows[routing] = row
                print(f"{plan.label} {routing}: {json.dumps(row, default=str)}", flush=True)
                write_json(report, args.json)
            if args.device == "cuda":
                # What the process holds after this budget's rows (NVML: the CUDA context,
                # torch's pools and the prefill's activations included).
                from quant_bench import vram_used_bytes

                rows["vram_process_bytes"], _ = vram_used_bytes()
                rows["torch_reserved_bytes"] = torch.cuda.memory_reserved()
        extra_rows(args, shape, plans, engine, non_expert, report)
    finally:
        engine.close()
        sync()


def budget_slots(args, store, plan: BudgetPlan, non_expert: int | None) -> int:
    """Strata's slots at a budget: on a GPU those whose mapped chunks fit what the measured
    non-expert VRAM and the margin leave (ExpertStore.slots_within), else the plan's."""
    if non_expert is None:
        return plan.slots
    room = plan.budget_bytes - non_expert - args.margin_mib * MIB
    return store.slots_within(max(room, 0))


def extra_rows(args, shape: FileShape, plans: list[BudgetPlan], engine,
               non_expert: int | None, report: dict) -> None:
    """After every budget's routing rows (the profiler slows what runs after it): per budget
    a decode profile under each of --profile-routings from a fresh resize and a warm-up
    (--profile-steps), a prefill profile under each (--profile-prefill), then the shrink
    while a stream decodes (--shrink-pause)."""
    from moe_budget_extras import (
        prefill_profile_row,
        print_prefill_profile,
        print_profile,
        print_shrink,
        profile_row,
        resize_settled,
        shrink_pause_row,
    )

    from strata.engine.core.models.forced_routing import ForcedRouting

    store = engine.memory.experts

    def trace(routing: str, seed: int, num_rows: int):
        return make_trace(TraceSpec(routing, args.zipf_s, args.p_reuse, seed), num_rows,
                          shape.num_layers, shape.num_experts, shape.top_k)

    def decode_profile(label: str, routing: str) -> dict:
        # Long enough not to wrap (a repeated row would hit): the warm-up, the unprofiled
        # and the profiled pass, and the prompt's rows.
        rows = args.warmup_tokens + 2 * args.profile_steps + 64
        forced = ForcedRouting(trace(routing, args.seed, rows), shape.num_experts, engine.device)
        profile = profile_row(engine, forced, args.profile_steps, args.warmup_tokens)
        print_profile(f"{label} {routing}", profile)
        return profile

    def prefill_profile(label: str, routing: str) -> dict:
        forced = ForcedRouting(trace(routing, args.seed, 64), shape.num_experts, engine.device)
        forced.set_prefill(trace(routing, args.seed + 1, args.prefill_tokens))
        profile = prefill_profile_row(engine, forced, args.prefill_tokens)
        print_prefill_profile(f"{label} {routing}", profile)
        return profile

    for key, wanted, measure in (("decode_profile", args.profile_steps, decode_profile),
                                 ("prefill_profile", args.profile_prefill, prefill_profile)):
        for plan in plans if wanted else []:
            profiles = report["strata"][plan.label].setdefault(key, {})
            for routing in args.profile_routings:
                if time.monotonic() > args.deadline:
                    profiles[routing] = {"skipped": "deadline"}
                    continue
                resize_settled(engine, report["strata"][plan.label]["slots"])
                profiles[routing] = measure(plan.label, routing)
                write_json(report, args.json)
    if args.shrink_pause:
        if time.monotonic() > args.deadline:
            report["shrink_pause"] = {"skipped": "deadline"}
            return
        target = plan_budget(shape, args.shrink_to, args.reserve_mib * MIB)
        row = shrink_pause_row(engine, store.max_slots,
                               budget_slots(args, store, target, non_expert),
                               args.shrink_tokens, args.shrink_after)
        row["to_label"] = target.label
        report["shrink_pause"] = row
        print_shrink(row)
        write_json(report, args.json)


def figures(args, plans: list[BudgetPlan], report: dict) -> list[dict]:
    """The table: per budget and routing, decode and prefill against llama.cpp's at that
    budget (ratio = Strata / llama.cpp), the hit rate and the bytes moved per token."""
    rows = []
    for plan in plans:
        peer = report.get("llamacpp", {}).get(plan.label, {})
        held = report.get("strata", {}).get(plan.label, {}).get("vram_process_bytes")
        rows.append(figure(f"{plan.label} VRAM held (process)",
                           None if held is None else held / GIB, "GiB", plan.budget_bytes / GIB,
                           1.0, "NVML, after the budget's rows; limit = the budget",
                           higher_is_better=False))
        note = (f"{plan.slots} slots ({plan.slots * 100 // max(1, report['total_experts'])}%"
                f" of experts); llama.cpp -ncmoe {plan.ncmoe}"
                + ("; the file fits: an engine here wires every expert" if plan.fits else ""))
        targets = not plan.fits  # the targets are for budgets the file does not fit
        for routing in args.routings:
            row = report.get("strata", {}).get(plan.label, {}).get(routing, {})
            name = f"{plan.label} {routing}"
            rows.append(figure(f"{name} decode", row.get("decode_tok_s"), "tok/s",
                               peer.get("decode_tok_s"),
                               DECODE_TARGETS.get(routing) if targets else None,
                               note + "; limit = llama.cpp's decode"))
            rows.append(figure(f"{name} prefill {args.prefill_tokens}",
                               row.get("prefill_tok_s"), "tok/s", peer.get("prefill_tok_s"),
                               PREFILL_TARGET if targets else None,
                               "limit = llama.cpp's prefill"))
            staged = row.get("prefill_staged_bytes")
            rows.append(figure(f"{name} prefill staged from host",
                               None if staged is None else staged / MIB, "MiB",
                               notes=f"{row.get('prefill_num_staged_copy_calls')} copy calls; "
                                     f"{(row.get('prefill_gathered_bytes') or 0) / MIB:.0f} "
                                     "MiB gathered from slots; staging "
                                     f"{(row.get('staging_bytes') or 0) / MIB:.0f} MiB"))
            rows.append(figure(f"{name} hit rate", row.get("hit_rate"), "",
                               notes="expert cache hits over the timed decode"))
            moved = row.get("h2d_bytes_per_token")
            rows.append(figure(f"{name} host->device per token",
                               None if moved is None else moved / MIB, "MiB",
                               notes="copies into slots + experts read in place"))
            copied = row.get("copied_bytes_per_token")
            rows.append(figure(f"{name} copied per token",
                               None if copied is None else copied / MIB, "MiB",
                               notes=f"left on the host: {row.get('left_out_fraction')} of "
                                     f"misses; {row.get('copy_calls_per_token')} copy calls "
                                     "a token"))
            rows.append(figure(f"{name} copy rate", row.get("copy_gb_s"), "GB/s",
                               report.get("pinned_h2d_gb_s"), 0.8,
                               "promotion copies, device-timed; limit = pinned host->device"))
    return rows


def run(args) -> dict:
    shape = file_shape(Path(args.gguf))
    reserve = args.reserve_mib * MIB
    plans = [plan_budget(shape, budget, reserve) for budget in args.budgets]
    report = {"benchmark": "moe_budget", "file": str(args.gguf),
              "file_bytes": Path(args.gguf).stat().st_size, "command": " ".join(sys.argv),
              "dense_bytes": shape.dense_bytes, "expert_bytes": shape.expert_bytes,
              "bytes_per_expert": shape.bytes_per_expert, "total_experts": shape.total_experts,
              "reserve_bytes": reserve,
              "trace": {"zipf_s": args.zipf_s, "p_reuse": args.p_reuse, "seed": args.seed},
              "plans": [plan.__dict__ | {"label": plan.label} for plan in plans]}
    for plan in plans:
        print(f"{plan.label}: experts get {plan.expert_bytes / MIB:.0f} MiB -> Strata "
              f"{plan.slots} of {shape.total_experts} slots; llama.cpp -ncmoe {plan.ncmoe} "
              f"({plan.gpu_expert_layer_bytes / MIB:.0f} MiB of experts on the GPU)"
              + ("; the file fits: not a budget row, no targets" if plan.fits else ""),
              flush=True)
    if args.device == "cuda":
        import torch
        from limits import pinned_bandwidth_gb_s

        report["pinned_h2d_gb_s"], _ = pinned_bandwidth_gb_s(torch.device("cuda", 0), GIB, 3)
    if args.bin_dir:
        from peer_run import unpack_tools

        tools = unpack_tools(Path(args.bin_dir), Path("/tmp/llamacpp-bin"), print)
        args.llama_bench = args.llama_bench or tools.get("llama-bench")
    if args.shrink_from_all:  # that row alone: its own all-resident load
        from moe_budget_extras import shrink_from_all

        shrink_from_all(args, shape, report)
        return report
    if args.llama_bench:
        llamacpp_rows(args, plans, report)
    strata_rows(args, shape, plans, report)
    report["figures"] = figures(args, plans, report)
    print(format_figures(report["figures"], "llama.cpp"), flush=True)
    write_json(report, args.json)
    return report


def parser() -> argparse.ArgumentParser:
    return moe_budget_bench_args.parser(__doc__.splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.deadline = time.monotonic() + args.deadline_s
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
