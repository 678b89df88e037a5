"""One GGUF file through Strata and llama.cpp's llama-bench: issue 19's table.

    python bench/quant_bench.py FILE.gguf [--llama-bench PATH] [--hbm-gb-s 4300]
                                [--label NAME] [--json out.json] [--device cpu]
                                [--pin-tiles OTHER.json]

Strata, through Engine (what the engine process runs; greedy, the server's CUDA graphs):
load time to ready (the file is in the page cache: it was just written; once more at the
end, with the kernel caches warm), VRAM held after load
(NVML: this process's memory, else the GPU's used memory over the baseline), decode tok/s at
batch 1, prefill tok/s of --prefill-tokens prompts (fresh slot each time, so no prefix is
reused) and the time to first token of the --ttft-tokens one; on an MoE file the expert
cache's release ms and refill GB/s (against pinned host-to-device bandwidth). Then the engine
is closed and llama-bench runs on the same file (every layer on the GPU, flash attention),
and the ratios: Strata/llama.cpp per figure, and decode against the quantized-bytes roofline
(weight bytes one token reads, as stored in the file, over --hbm-gb-s; roofline.py). Where
Strata fails on the file, llama-bench still runs: one row says why, the exit status is 1.

The JSON records the tile each dp4a product ran (`strata.dp4a_tiles`). A tree that edits a
file holding those kernels tunes them afresh, so an A/B of two trees may compare tiles as
well as the change (docs/benchmarks.md, run 30): `--pin-tiles` takes the tiles of another
run's JSON (same file, same GPU) instead of tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # the checkout, for strata
sys.path.insert(0, str(BENCH_DIR))

from strata.engine.core.process import use_engine_allocator

# Before torch is imported: the VRAM rows measure the allocator the server's engine runs.
use_engine_allocator()

from batch_bench import first_token_s, prompt, sync, take
from llamacpp_peer import bench_command, parse_results
from report import figure, format_figures, write_json
from roofline import decode_weight_bytes

from strata.engine.gguf_file import open_gguf

DECODE_ROOFLINE_TARGET = 0.6
PEER_DECODE_TARGET = 1.2
PEER_PREFILL_TARGET = 1.0
VRAM_SLACK = 1.10  # VRAM held <= file + KV + 10%
REFILL_TARGET = 0.85


def vram_used_bytes() -> tuple[int | None, int | None]:
    """(this process's GPU memory per NVML, the GPU's used memory); None where unknown."""
    from strata.engine.core.memory.vram import gpu_processes, read_vram_info

    own = next((p.used_bytes for p in gpu_processes(0) if p.pid == os.getpid()), None)
    info = read_vram_info(0)
    return own, None if info is None else info.used_bytes


def memory_breakdown(engine, process_bytes: int | None) -> dict:
    """Where the VRAM held after load goes: each arena's resident bytes, torch's allocator
    (activations and the graph pools), the quantized prefill scratch, and the rest of the
    process's NVML figure (the CUDA context and the kernels' code)."""
    import torch

    from strata.engine.core.quant.weight import scratch_bytes

    arenas = {name: int(row.get("resident_bytes", 0))
              for name, row in engine.status().get("arenas", {}).items()}
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    known = sum(arenas.values()) + reserved
    return {"arena_resident_bytes": arenas, "torch_reserved_bytes": reserved,
            "torch_allocated_bytes": (torch.cuda.memory_allocated()
                                      if torch.cuda.is_available() else 0),
            "quant_scratch_bytes": scratch_bytes(),
            "torch_pools": torch_pools() if torch.cuda.is_available() else {},
            "context_and_other_bytes": (None if process_bytes is None
                                        else process_bytes - known)}


def torch_pools(top: int = 8) -> dict:
    """torch's reserved memory per pool (the default one, each CUDA graph's private pool):
    reserved and allocated bytes and the largest allocated blocks, from its memory snapshot,
    so a reserved-but-free figure can be told from graph pools and live buffers."""
    import torch

    pools: dict[str, dict] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = pools.setdefault(str(segment.get("segment_pool_id")),
                                {"segments": 0, "reserved_bytes": 0, "allocated_bytes": 0,
                                 "largest_allocated_bytes": []})
        pool["segments"] += 1
        pool["reserved_bytes"] += segment["total_size"]
        pool["allocated_bytes"] += segment["allocated_size"]
        pool["largest_allocated_bytes"] += [block["size"] for block in segment["blocks"]
                                            if block["state"] == "active_allocated"]
    for pool in pools.values():
        pool["largest_allocated_bytes"] = sorted(pool["largest_allocated_bytes"])[::-1][:top]
    return pools


def _timed_s(fn) -> tuple[object, float]:
    sync()
    started_s = time.perf_counter()
    result = fn()
    sync()
    return result, time.perf_counter() - started_s


def deferred_figures(engine, raw: dict) -> list[dict]:
    """Run the compiles a load with stored tunings deferred (the prefill groups: it prefills
    eagerly until then), as the engine process does once idle after its Load reply; the
    rows measured after meet what a server serves once it has been idle that long. Run 22d's
    prompts met the eager groups instead, and prefilled 40% slower."""
    started_s = time.perf_counter()
    steps = engine.run_deferred_work()
    seconds = time.perf_counter() - started_s
    raw["deferred"] = {"steps": steps, "seconds": round(seconds, 3)}
    if not steps:
        return []
    return [figure("deferred compile after ready", seconds, "s", notes=", ".join(steps))]


def prefill_plan(engine) -> dict:
    """How the measured prompts prefill: the longest fresh prompt replayed from a whole-prompt
    graph (0: all called), whether the experts' grouped path replays per layer, and whether
    the element-wise groups are compiled (after any deferred compile) - run 21b's row could
    not tell which of these its prompts took."""
    prefiller = getattr(getattr(engine, "fast", None), "prefiller", None)
    if prefiller is None:  # the plain torch path (the CPU's)
        return {"fast_path": False, "graph_tokens": 0, "expert_graphs": False,
                "compiled_groups": False}
    graphs = prefiller.graphs
    return {"fast_path": True, "graph_tokens": graphs.max_tokens if graphs is not None else 0,
            "expert_graphs": prefiller.expert_graphs is not None,
            "compiled_groups": bool(prefiller.ops.is_compiled)}


def pin_tiles(other_json: str) -> int:
    """Pin the dp4a tiles another run of this bench recorded (gemv_dp4a.pin_tiles)."""
    from strata.engine.core.quant import gemv_dp4a

    tiles = json.loads(Path(other_json).read_text()).get("strata", {}).get("dp4a_tiles")
    if not tiles:
        raise SystemExit(f"{other_json} records no dp4a tiles (a quant_bench JSON of a CUDA "
                         f"run since run 30)")
    try:
        return gemv_dp4a.pin_tiles(tiles)
    except ValueError as exc:
        raise SystemExit(f"--pin-tiles {other_json}: {exc}") from None


def strata_figures(args, path: Path, weights: dict) -> tuple[list[dict], dict]:
    """Load the file in Strata and measure; (figures, raw numbers)."""
    from lifecycle_bench import decode_tok_s

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.loader.quant_plan import kv_bytes

    _, baseline_used = vram_used_bytes()
    pinned = pin_tiles(args.pin_tiles) if args.pin_tiles else 0
    context = max(args.prefill_tokens) + args.decode_tokens + 64
    engine = Engine(EngineConfig(model_path=str(path), device=args.device, num_slots=1,
                                 context_tokens=context, expert_cache=args.expert_cache,
                                 prefill_chunk_tokens=args.chunk_tokens))
    info, load_s = _timed_s(engine.load)
    own, used = vram_used_bytes()
    config = engine.model_config
    kv = kv_bytes(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, context)
    from strata.engine.core.fast.tuning_store import device_identity

    raw = {"device": device_identity(engine.device),  # GPU, driver, CUDA, torch, Triton
           "load": info, "context_tokens": context, "kv_bytes": kv, "vram_process_bytes": own,
           "dp4a_tiles_pinned": pinned,
           "vram_used_bytes": used, "vram_baseline_bytes": baseline_used,
           "memory_after_load": memory_breakdown(engine, own)}
    held = own if own is not None else (None if used is None else used - baseline_used)
    file_bytes = path.stat().st_size
    rows = [figure("load to ready (first, page cache)", load_s, "s",
                   notes=str(info["load_phases_s"]))]
    rows.append(figure("VRAM held after load", None if held is None else held / 2**30, "GiB",
                       (file_bytes + kv) / 2**30, VRAM_SLACK,
                       "limit = file + KV at the context" + ("" if own is not None else
                                                             "; GPU used over baseline"),
                       higher_is_better=False))
    rows += deferred_figures(engine, raw)
    raw["prefill_plan"] = prefill_plan(engine)
    vocab = config.vocab_size
    decode_tok_s(engine, 16, 0)  # captures the decode graphs, compiles the kernels
    decode = max(decode_tok_s(engine, args.decode_tokens, 0) for _ in range(args.repeats))
    raw["decode_tok_s"] = decode
    roofline = args.hbm_gb_s * 1e9 / weights["per_token_bytes"]
    rows.append(figure("decode bs1", decode, "tok/s", roofline, DECODE_ROOFLINE_TARGET,
                       f"limit: quantized-bytes roofline at {args.hbm_gb_s:.0f} GB/s"))
    for num_tokens in args.prefill_tokens:
        runs_s = []
        for repeat in range(args.repeats + 1):  # the first run captures/compiles: unmeasured
            # The slot is not erased (that drops its prefill graphs): each prompt differs from
            # the last from its first token, so none of it is cached.
            ids = prompt(vocab, 100 * num_tokens + repeat, num_tokens)
            runs_s.append(first_token_s(engine, f"prefill-{num_tokens}-{repeat}", ids, 0))
        best_s = min(runs_s[1:])
        raw[f"prefill_{num_tokens}_s"] = best_s
        # Every run, the unmeasured first included: a spread inside one call tells noise
        # from a slower machine (run 23's 4096-token rows).
        raw[f"prefill_{num_tokens}_runs_s"] = runs_s
        rows.append(figure(f"prefill {num_tokens} tok", num_tokens / best_s, "tok/s",
                           notes=f"prompt in, first token out; chunk {args.chunk_tokens}"))
        if num_tokens == args.ttft_tokens:
            rows.append(figure(f"TTFT {num_tokens} tok", best_s * 1e3, "ms"))
    # What serving holds once the longest prompt ran: torch keeps its chunk's activations.
    own_after, used_after = vram_used_bytes()
    held_after = own_after if own_after is not None else (
        None if used_after is None else used_after - baseline_used)
    raw["vram_after_prefill_bytes"] = held_after
    raw["memory_after_prefill"] = memory_breakdown(engine, own_after)
    rows.append(figure("VRAM held after the prefill rows",
                       None if held_after is None else held_after / 2**30, "GiB",
                       (file_bytes + kv) / 2**30, notes="the longest prompt's activations "
                       "stay in torch's cache", higher_is_better=False))
    if engine.memory.experts is not None and args.cycles > 0:  # --cycles 0: decode A/B runs
        rows += expert_figures(args, engine, raw)
    if args.device == "cuda":
        from strata.engine.core.quant import gemv_dp4a

        raw["dp4a_tiles"] = gemv_dp4a.tuned_tiles()  # which tile each product ran (run 30)
    if args.profile_steps:
        # Last: the profiler leaves the rows after it slower (run 22d's 8B prefilled 4096
        # tokens at 12881 tok/s after a profile, run 22e's at 29614-31419 without one).
        raw["decode_profile"] = decode_profile(engine, args.profile_steps)
    if args.profile_prefill:
        raw["prefill_profile"] = prefill_profile(engine, args.profile_prefill)
    if not args.no_reload:
        # The first load of a fresh machine compiles kernels; a user's later loads find them
        # in the caches (the target is for that load).
        engine.close()
        info, reload_s = _timed_s(engine.load)
        raw["reload"] = info
        rows.insert(1, figure("load to ready (warm kernel caches)", reload_s, "s",
                              notes=str(info["load_phases_s"])))
    engine.close()
    sync()
    return rows, raw


def prefill_profile(engine, num_tokens: int, top: int = 24) -> dict:
    """Where one fresh prompt's prefill goes (the MoE prefill target's profile): a prompt of
    num_tokens run once unprofiled (its whole-prompt graph, if it takes one, is captured
    then; its wall is the prompt's time without the profiler's host work), then another of
    the same length under torch.profiler, first token out; of the GPU's busy time, what
    host->device and device->device copies took (a partial expert cache's staging)."""
    import torch
    from profile_decode import copy_us, kernel_table, print_table
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    unprofiled_s = first_token_s(engine, "profile-warm", prompt(vocab, 7 * num_tokens,
                                                                 num_tokens), 0)
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        wall_s = first_token_s(engine, "profile", prompt(vocab, 7 * num_tokens + 1, num_tokens),
                               0)
    table = kernel_table(prof)
    print_table(f"prefill of {num_tokens} tokens (one prompt)", table, 1, wall_s, top)
    rows = sorted(table.items(), key=lambda item: -item[1][2])
    return {"tokens": num_tokens, "wall_us": wall_s * 1e6,
            "wall_unprofiled_us": unprofiled_s * 1e6,
            "kernel_us": sum(row[1] for row in table.values()),
            "busy_us": sum(row[2] for row in table.values()), **copy_us(table),
            "kernels": [{"name": name[:120], "launches": n, "us": us, "exclusive_us": ex}
                        for name, (n, us, ex) in rows[:top]]}


def decode_profile(engine, num_tokens: int, top: int = 24, warmup_tokens: int = 0) -> dict:
    """Where a decode token's GPU time goes (the roofline target's "profile that says why"):
    after `warmup_tokens` (an expert cache settles on its routing first), `num_tokens` greedy
    tokens timed without the profiler, then `num_tokens` more under torch.profiler (kernels
    inside the CUDA graphs' replays included): per kernel name the launches and microseconds
    a token, against the wall time of each pass (the profiler's own host work slows the
    profiled pass, so the unprofiled wall is the token's real time)."""
    import torch
    from profile_decode import copy_us, kernel_table, print_table
    from torch.profiler import ProfilerActivity, profile

    from strata.engine.protocol import SamplingSpec

    spec = SamplingSpec(max_tokens=1 + warmup_tokens + 2 * num_tokens, temperature=0.0)
    steps = engine.generate(list(range(1, 33)), spec, slot=0)
    take(steps, 1 + warmup_tokens)  # the first token carries the prefill
    sync()
    started_s = time.perf_counter()
    unprofiled = take(steps, num_tokens)
    sync()
    unprofiled_s = time.perf_counter() - started_s
    # The CPU dry run has no kernels to list; it checks the machinery.
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        started_s = time.perf_counter()
        count = sum(len(ids) for ids in steps)
        sync()
        wall_s = time.perf_counter() - started_s
    table = kernel_table(prof)
    print_table(f"decode token ({count} profiled)", table, count, wall_s, top)
    rows = sorted(table.items(), key=lambda item: -item[1][2])
    return {"tokens": count, "warmup_tokens": warmup_tokens,
            "wall_us_per_token": wall_s * 1e6 / count,
            "wall_unprofiled_us_per_token": unprofiled_s * 1e6 / unprofiled,
            "kernel_us_per_token": sum(row[1] for row in table.values()) / count,
            "busy_us_per_token": sum(row[2] for row in table.values()) / count,
            **{f"{key}_per_token": us / count for key, us in copy_us(table).items()},
            "kernels": [{"name": name[:120], "launches_per_token": n / count,
                         "us_per_token": us / count, "exclusive_us_per_token": ex / count}
                        for name, (n, us, ex) in rows[:top]]}


def expert_figures(args, engine, raw: dict) -> list[dict]:
    """Release and refill of the (quantized) expert cache, as lifecycle_bench.py times them."""
    import statistics

    from limits import pinned_bandwidth_gb_s

    h2d = None
    if args.device != "cpu":
        import torch

        h2d, _ = pinned_bandwidth_gb_s(torch.device("cuda", 0), 1 << 30, 5)
    expert_bytes = engine.memory.experts.arena.resident_bytes
    release_ms, refill_gb_s = [], []
    for _ in range(args.cycles):
        _, seconds = _timed_s(engine.release_experts)
        release_ms.append(seconds * 1e3)
        refill, seconds = _timed_s(engine.refill_experts)
        refill_gb_s.append(refill["copied_bytes"] / seconds / 1e9)
    raw |= {"expert_bytes": expert_bytes, "release_ms": release_ms, "refill_gb_s": refill_gb_s,
            "pinned_h2d_gb_s": h2d}
    return [figure(f"release experts ({expert_bytes / 2**30:.2f} GiB)",
                   statistics.median(release_ms), "ms"),
            figure("refill experts incl. mapping", statistics.median(refill_gb_s), "GB/s",
                   h2d, REFILL_TARGET, "limit: pinned host-to-device copy")]


def llamacpp_figures(args, path: Path, ours: dict) -> tuple[list[dict], dict]:
    """llama-bench on the same file; its rows, with ratio = Strata / llama.cpp."""
    small, large = min(args.prefill_tokens), max(args.prefill_tokens)
    peer_args = Namespace(llama_bench=args.llama_bench, prefill_tokens=large,
                          prompt_tokens=small, decode_tokens=args.decode_tokens,
                          gpu_layers=99, ubatch=args.ubatch)
    command = bench_command(peer_args, path)
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          timeout=args.llamacpp_timeout_s)
    if done.returncode != 0:
        note = f"llama-bench failed ({done.returncode}): {done.stderr[-600:]}"
        return [figure("llama.cpp", None, "-", notes=note)], {"error": note}
    peer = parse_results(done.stdout, peer_args)
    peer["prompt_tok_s"] = small / peer["ttft_ms"] * 1e3
    peer["command"] = " ".join(command)
    desc = f"llama.cpp {peer['llamacpp']} {peer['backends']}; ratio = Strata / llama.cpp"
    rows = []
    # limit = llama.cpp's figure, so ratio = Strata / llama.cpp (target: beat it).
    for name, key, mine, target in (
        ("decode bs1", "decode_tok_s", ours.get("decode_tok_s"), PEER_DECODE_TARGET),
        (f"prefill {large} tok", "prefill_tok_s",
         large / ours[f"prefill_{large}_s"] if f"prefill_{large}_s" in ours else None,
         PEER_PREFILL_TARGET),
        (f"prefill {small} tok", "prompt_tok_s",
         small / ours[f"prefill_{small}_s"] if f"prefill_{small}_s" in ours else None,
         PEER_PREFILL_TARGET),
    ):
        rows.append(figure(f"vs llama.cpp {name}", mine, "tok/s", peer[key], target,
                           f"llama.cpp {peer[key]:.1f} tok/s; {desc}"))
    return rows, peer


def _strata_or_error(args, path: Path, weights: dict) -> tuple[list[dict], dict]:
    """strata_figures, or where Strata fails (a family whose fast path is not there yet) one
    row saying why: llama.cpp's rows on the file are still worth having (issue 52's table)."""
    import gc
    import traceback

    try:
        return strata_figures(args, path, weights)
    except Exception as exc:  # noqa: BLE001 - the peer's rows must not be lost with Strata's
        note = f"Strata failed: {type(exc).__name__}: {exc}"
        error = traceback.format_exc()
    gc.collect()  # the failed engine's tensors, before llama-bench wants the memory
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except RuntimeError:
        pass  # a broken CUDA context: llama-bench runs in its own process anyway
    print(error, file=sys.stderr, flush=True)
    return [figure("Strata", None, "-", notes=note[:600])], {"error": error}


def run(args) -> dict:
    path = Path(args.gguf)
    weights = decode_weight_bytes(open_gguf(path))
    label = args.label or path.stem
    figures, raw = _strata_or_error(args, path, weights)
    report = {"benchmark": "quant", "file": str(path), "file_bytes": path.stat().st_size,
              "label": label, "weights": weights, "hbm_gb_s": args.hbm_gb_s,
              "figures": figures, "strata": raw, "llamacpp": None,
              "command": " ".join(sys.argv)}
    write_json(report, args.json)  # now too: a peer cut by a deadline keeps Strata's rows
    if args.llama_bench:
        peer_rows, report["llamacpp"] = llamacpp_figures(args, path, raw)
        figures += peer_rows
    for row in figures:
        row["figure"] = f"{label} {row['figure']}"
    print(format_figures(figures), flush=True)
    write_json(report, args.json)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", help="the GGUF file (bench/random_gguf.py writes one)")
    p.add_argument("--label", help="row prefix (default: the file's stem)")
    p.add_argument("--llama-bench", help="llama-bench binary: adds llama.cpp's rows")
    p.add_argument("--hbm-gb-s", type=float, default=4300.0, help="HBM bandwidth for the "
                   "roofline (H200: 4800 GB/s peak, ~4300 measured by copy)")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--ttft-tokens", type=int, default=512)
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="Strata's prefill chunk (the server's default)")
    p.add_argument("--ubatch", type=int, default=2048, help="llama-bench -ub (and -b)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cycles", type=int, default=3, help="expert release/refill cycles")
    p.add_argument("--expert-cache", default="auto")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many decode tokens per kernel (0: none)")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="TOKENS",
                   help="profile one fresh prompt of this many tokens per kernel (0: none)")
    p.add_argument("--no-reload", action="store_true",
                   help="skip the second load (kernel caches warm)")
    p.add_argument("--llamacpp-timeout-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda", help="cpu for a dry run")
    p.add_argument("--json")
    p.add_argument("--pin-tiles", metavar="OTHER.json",
                   help="run the dp4a products on the tiles another run recorded, untuned")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats takes 1 or more: each row is the best of that many measured runs")
    report = run(args)
    return 1 if "error" in report["strata"] else 0


if __name__ == "__main__":
    sys.exit(main())
