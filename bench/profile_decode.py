"""Where one decode step's GPU time goes: per-kernel CUDA time by torch.profiler.

    python bench/profile_decode.py [--models qwen3-30b-a3b llama3-8b] [--steps 8]
        [--prefill-tokens 4096]

For each model (random weights, bf16): decode `--steps` tokens by CUDA-graph replay after a
512-token prompt under the profiler, then print per kernel name the launches and microseconds
per step, the sum of kernel time per step against the wall time per step (the difference is
launch gaps and idle GPU), and the roofline time. With --prefill-tokens, one prefill of that
many tokens is profiled the same way (MoE routing / sort / scatter against the grouped GEMMs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from limits import best_wall_s
from speed_rows import GREEDY, _prompt, decode_bytes_per_token, engine_model
from torch.profiler import ProfilerActivity, profile

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.kv_cache import KVCache

PROMPT_TOKENS = 512


def kernel_table(prof) -> dict[str, list[float]]:
    """{kernel name: [launches, total microseconds, exclusive microseconds]} of the GPU events
    of a profile.

    Exclusive time counts a kernel's span only from when the kernel before it (by start)
    ended: with PDL a kernel starts early and waits for its predecessor inside, so its total
    includes that wait and the totals add up to more than the wall time. The exclusive times
    add up to the GPU's busy time; the wall time less them is idle GPU (launch gaps)."""
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    spans = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        row = table[event.name]
        row[0] += 1
        row[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        span = getattr(event, "time_range", None)
        if span is not None:
            spans.append((span.start, span.end, event.name))
    busy_until = float("-inf")
    for start, end, name in sorted(spans):
        table[name][2] += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    return table


# Kernel names of copies in torch.profiler's CUDA events ("Memcpy HtoD (Pinned -> Device)",
# "Memcpy DtoD (Device -> Device)"): a partial expert cache's promotion and staging.
HTOD_MARKS = ("HtoD", "memcpy_htod")
DTOD_MARKS = ("DtoD",)


def copy_us(table: dict[str, list[float]]) -> dict[str, float]:
    """Of a kernel_table, the exclusive microseconds in host->device and device->device
    copies."""
    def marked(marks: tuple[str, ...]) -> float:
        return sum(row[2] for name, row in table.items() if any(m in name for m in marks))
    return {"htod_us": marked(HTOD_MARKS), "dtod_us": marked(DTOD_MARKS)}


def print_table(title: str, table: dict, per: int, wall_s: float, top: int) -> None:
    total_us = sum(row[1] for row in table.values()) / per
    busy_us = sum(row[2] for row in table.values()) / per
    launches = sum(row[0] for row in table.values()) / per
    wall_us = wall_s * 1e6 / per
    print(f"== {title}: {launches:.0f} kernels, {total_us:.0f} us kernel time, {busy_us:.0f} us "
          f"GPU busy (exclusive), {wall_us:.0f} us wall per step (idle {wall_us - busy_us:.0f} us)")
    print("  exclusive us  share  launches  total us  us/launch  kernel")
    rows = sorted(table.items(), key=lambda item: -item[1][2])
    for name, (count, us, exclusive_us) in rows[:top]:
        print(f"  {exclusive_us / per:9.1f} {exclusive_us / max(busy_us * per, 1e-9):6.1%} "
              f"{count / per:8.1f}x {us / per:9.1f} {us / max(count, 1):8.2f}   {name[:90]}")
    if len(rows) > top:
        rest = sum(row[2] for _, row in rows[top:]) / per
        print(f"  {rest:9.1f} us in {len(rows) - top} other kernel names")


def decode_variants(label: str, model, kv: KVCache, prompt: torch.Tensor, ops,
                    num_tokens: int = 64) -> None:
    """Decode tok/s (best of 3, graphs, no profiler) with the projections and norms on torch
    or Triton, with and without PDL, with and without the GEMVs' prologues: what each step of
    the Triton decode chain gives."""
    variants = [("torch projections and norms", False, False, False),
                ("Triton projections and norms", True, False, False)]
    if ops.pdl:
        variants.append(("Triton projections and norms, PDL", True, True, False))
    variants.append(("Triton, PDL where the GPU has it, norms and SiLU in the GEMVs' prologues",
                     True, ops.pdl, True))
    for name, dense, use_pdl, prologues in variants:
        decoder = GraphDecoder(model)
        decoder.ops = dataclasses.replace(decoder.ops, dense_kernels=dense, pdl=use_pdl,
                                          gemv_prologues=prologues)
        first = decoder.sample_first(decoder.prefill(kv, prompt, 0), GREEDY)
        decoder.prepare(kv, PROMPT_TOKENS, num_tokens, GREEDY)
        best_s = best_wall_s(
            lambda d=decoder, f=first: list(d.decode(kv, f, PROMPT_TOKENS, num_tokens, GREEDY)), 3)
        decoder.clear()
        print(f"{label} decode, {name}: {num_tokens / best_s:.1f} tok/s "
              f"({best_s / num_tokens * 1e6:.0f} us/token)", flush=True)


def profile_model(label: str, args, device) -> None:
    model = engine_model(label, device)
    config = model.config
    kv = KVCache.for_config(config, 2048, torch.bfloat16, device)
    decoder = GraphDecoder(model)
    print(f"## {label}: moe_impl={decoder.moe_impl} graphs={decoder.use_cuda_graphs} "
          f"compiled={decoder.ops.is_compiled} fused_attention={decoder.ops.fused_attention} "
          f"{decoder.note}", flush=True)
    prompt = _prompt(config, PROMPT_TOKENS, device)
    first = decoder.sample_first(decoder.prefill(kv, prompt, 0), GREEDY)
    decoder.prepare(kv, PROMPT_TOKENS, args.steps + 4, GREEDY)
    list(decoder.decode(kv, first, PROMPT_TOKENS, 4, GREEDY))  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        list(decoder.decode(kv, first, PROMPT_TOKENS, args.steps, GREEDY))
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    roofline_us = decode_bytes_per_token(config, PROMPT_TOKENS) / (args.hbm_gb_s * 1e3)
    print(f"roofline {roofline_us:.0f} us/token at {args.hbm_gb_s:.0f} GB/s; "
          f"{config.num_hidden_layers} layers")
    print_table(f"{label} decode step", kernel_table(prof), args.steps, wall_s, args.top)
    decoder.clear()
    decode_variants(label, model, kv, prompt, decoder.ops)
    if args.prefill_tokens and config.is_moe:
        long_kv = KVCache.for_config(config, args.prefill_tokens, torch.bfloat16, device)
        tokens = _prompt(config, args.prefill_tokens, device)
        decoder.prefill(long_kv, tokens, 0)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            decoder.prefill(long_kv, tokens, 0)
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
        print_table(f"{label} prefill {args.prefill_tokens} tok", kernel_table(prof), 1,
                    wall_s, args.top)
        # Host time by operator: where the launch gaps come from.
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        for name, ops in (("compiled", decoder.prefill_ops), ("eager", EAGER_OPS)):
            decoder.prefill_ops, kept = ops, decoder.prefill_ops
            decoder.prefill(long_kv, tokens, 0)
            times_ms = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                decoder.prefill(long_kv, tokens, 0)
                torch.cuda.synchronize()
                times_ms.append((time.perf_counter() - t0) * 1e3)
            decoder.prefill_ops = kept
            print(f"{label} prefill {args.prefill_tokens} tok, {name} element-wise ops: "
                  f"{' '.join(f'{t:.1f}' for t in times_ms)} ms")
        del long_kv
    del model, kv
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "llama3-8b"])
    parser.add_argument("--steps", type=int, default=8, help="decode steps profiled")
    parser.add_argument("--prefill-tokens", type=int, default=4096,
                        help="also profile one MoE prefill of this many tokens (0: skip)")
    parser.add_argument("--top", type=int, default=22, help="kernel names printed")
    parser.add_argument("--hbm-gb-s", type=float, default=4242.0,
                        help="HBM bandwidth for the roofline (the suite's measured limit)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode: no CUDA GPU here; it profiles GPU kernels")
    for label in args.models:
        try:
            profile_model(label, args, torch.device("cuda"))
        except Exception as exc:  # noqa: BLE001 - one model failing must not hide the other
            print(f"## {label}: profile failed: {type(exc).__name__}: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
