"""bench/moe_budget_bench.py's command line: the budgets' syntax, the flags and their checks
(moved out of the bench, which runs the rows)."""

from __future__ import annotations

import argparse
import re

from routing_trace import ROUTINGS

from strata.units import GIB, MIB

RESERVE_MIB = 2048  # = residency.EXPERT_RESERVE_BYTES, what --expert-cache auto leaves free
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(MiB|GiB)\s*$", re.IGNORECASE)


def parse_budget(text: str) -> int:
    """'12GiB' or '512MiB' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"a budget is like 12GiB or 512MiB, not {text!r}")
    return int(float(match.group(1)) * (GIB if match.group(2).lower() == "gib" else MIB))


def parser(description: str) -> argparse.ArgumentParser:
    """moe_budget_bench.py's command line (its module docstring says what each does)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("gguf", help="a MoE GGUF (bench/random_gguf.py qwen3-30b-a3b F --type Q4_K_M)")
    p.add_argument("--budgets", type=parse_budget, nargs="+",
                   default=[parse_budget(b) for b in ("12GiB", "8GiB", "16GiB")],
                   help="measured in this order (the first rows first, if time runs out)")
    p.add_argument("--routings", nargs="*", default=[*ROUTINGS, "model"],
                   choices=[*ROUTINGS, "model"],
                   help="the decode and prefill rows per budget (none: only what "
                   "--profile-steps and --shrink-pause add)")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of popularity")
    p.add_argument("--p-reuse", type=float, default=0.3,
                   help="probability that each of the last token's experts is used again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="lfu", choices=["lfu", "lru"],
                   help="the expert cache's replacement (lru: the one before issue 54, which "
                   "copies every miss in), for an A/B on one machine")
    p.add_argument("--cpu-misses", default="off", choices=["off", "on", "auto"],
                   help="Strata's cpu_expert_misses: one token's misses computed on the CPU "
                   "(on; auto once their CPU form is made) or read in place (off)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch CPU threads for the CPU-computed misses (0: torch's default)")
    p.add_argument("--cpu-miss-graphs", action="store_true",
                   help="with --cpu-misses, replay the decode step cut at each MoE layer as "
                   "CUDA graphs (STRATA_CPU_MISS_GRAPHS=1) instead of calling it")
    p.add_argument("--cpu-max-per-layer", type=int,
                   help="with --cpu-misses, at most this many of a layer's misses a token on "
                   "the CPU, the others read in place (default: all with a CPU form)")
    p.add_argument("--cpu-share", type=share_arg,
                   help="with --cpu-misses, this fraction (0 to 1] of a layer's misses a "
                   "token on the CPU, rounded up, the others read in place; auto: each "
                   "layer's own, balanced a token at a time")
    p.add_argument("--prefetch", type=int, default=0,
                   help="with --cpu-misses, at each MoE layer's split guess this many of the "
                   "next layer's experts and copy the missing ones in (fast/moe_prefetch.py; "
                   "0: off)")
    p.add_argument("--prefetch-recall", type=recall_arg,
                   help="with --prefetch, forced rows guess from their trace, each routed "
                   "expert kept with this probability (TraceGuess), instead of the next "
                   "router's guess, which a forced trace leaves nothing to predict")
    p.add_argument("--cpu-cache-gib", type=float, default=4.0,
                   help="bytes the CPU forms of missed experts may keep, in GiB")
    p.add_argument("--cpu-preconvert", action="store_true",
                   help="after each resize, make the CPU forms of the experts with no slot "
                   "(up to --cpu-cache-gib) before the rows")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--warmup-tokens", type=int, default=256,
                   help="decoded before the timed tokens of each row (run 38 and before: 16)")
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--reserve-mib", type=int, default=RESERVE_MIB,
                   help="of each budget, what KV, activations and graphs keep (llama.cpp's "
                   "-ncmoe, and Strata's slots where VRAM cannot be measured)")
    p.add_argument("--margin-mib", type=int, default=256,
                   help="on a GPU, Strata's slots fit budget - measured non-expert VRAM - "
                   "this margin")
    p.add_argument("--llama-bench", help="llama-bench binary (bench/build_llamacpp.sh)")
    p.add_argument("--bin-dir", help="a folder holding llama-bench or llama-bench.xz (as "
                   "peer_run.py takes it): unpacked into /tmp/llamacpp-bin")
    p.add_argument("--ubatch", type=int, default=2048, help="llama-bench -ub")
    p.add_argument("--llamacpp-repeats", type=int, default=2, help="llama-bench -r")
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="rows not started by then are skipped (a device call's limit)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="per budget, after all routing rows, a decode profile of this many "
                   "tokens under each --profile-routings trace, after --warmup-tokens of it "
                   "(0: none)")
    p.add_argument("--profile-routings", nargs="+", default=["zipf"], choices=list(ROUTINGS))
    p.add_argument("--profile-prefill", action="store_true",
                   help="per budget, after the decode profiles, one --prefill-tokens prompt "
                   "profiled under each --profile-routings prefill trace")
    p.add_argument("--shrink-pause", action="store_true",
                   help="last: shrink from the load's largest slots to --shrink-to while a "
                   "greedy stream decodes (model's routes); token gaps and equality")
    p.add_argument("--shrink-from-all", action="store_true",
                   help="only the shrink row, from a load with every expert resident (wired) "
                   "to --shrink-to: the live switch to the partial cache")
    p.add_argument("--shrink-to", type=parse_budget, default=parse_budget("12GiB"))
    p.add_argument("--shrink-tokens", type=int, default=96)
    p.add_argument("--shrink-after", type=int, default=32,
                   help="tokens of the stream before the shrink")
    p.add_argument("--device", default="cuda", help="cpu for a dry run")
    p.add_argument("--json")
    return p


def share_arg(text: str) -> float | str:
    """--cpu-share: a finite fraction in (0, 1], or auto."""
    if text == "auto":
        return text
    value = float(text)
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"the CPU's share is a fraction in (0, 1], not {text}")
    return value


def recall_arg(text: str) -> float:
    """--prefetch-recall: a finite fraction in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"the guess's recall is a fraction in [0, 1], not "
                                         f"{text}")
    return value
