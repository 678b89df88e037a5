"""`strata bench`: decode, prefill and lifecycle speed on the GPU against measured limits and
a peer.

    python bench/suite.py --out DIR [--models llama3-8b qwen3-30b-a3b] [--no-peer]
                          [--no-lifecycle]

Measures the limits first (HBM bandwidth by device copy, bf16 matrix rate, pinned PCIe), then
runs every row function in ROWS for each model (random weights, bf16, on the GPU), then the
transformers peer per model in a subprocess with a timeout, then the lifecycle scripts
(lifecycle_rows.py: release/refill experts, offload/restore, slot switch, sleep/wake, decode
with 25% of the experts cached, unload/load), each in a subprocess. Prints one table and
writes DIR/bench.json (hardware, versions, figure, limit, ratio, target; the lifecycle
scripts' whole reports under "lifecycle"). Targets: DESIGN.md §8.

Extension point: ROWS is a list of functions (ctx, model, label) -> list of figure dicts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # limits.py, speed_rows.py next to this file

import speed_rows
import torch
from lifecycle_rows import lifecycle_rows
from limits import measure_limits
from report import figure, format_figures  # bench/report.py, next to this file

DEFAULT_MODELS = ("llama3-8b", "qwen3-30b-a3b", "smollm2-135m")
LONG_PROMPT_MODEL = "llama3-8b"


@dataclass
class BenchContext:
    args: argparse.Namespace
    device: torch.device
    limits: dict
    figures: list[dict] = field(default_factory=list)
    lifecycle: dict = field(default_factory=dict)  # the lifecycle scripts' reports by name
    started_s: float = field(default_factory=time.perf_counter)

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started_s:6.1f}s] {message}", flush=True)


def decode_row(ctx, model, label):
    impls = ctx.args.moe_impls if model.config.is_moe else ["auto"]
    return speed_rows.decode_rows(ctx, model, label, impls)


def prefill_row(ctx, model, label):
    return speed_rows.prefill_rows(ctx, model, label, ctx.args.prefill_tokens)


def long_prompt_row(ctx, model, label):
    if label != LONG_PROMPT_MODEL or not ctx.args.long_prompt_tokens:
        return []
    return speed_rows.prefill_rows(ctx, model, label, ctx.args.long_prompt_tokens, oom_check=True)


# Each: (ctx, model, label) -> list of figure dicts. Append lifecycle rows here.
ROWS = [decode_row, prefill_row, long_prompt_row]


def _peer_results(stdout: str | bytes | None) -> dict | None:
    """The last `PEER_JSON` line of a peer's output (a timed-out peer keeps its eager stage)."""
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    lines = [ln for ln in (stdout or "").splitlines() if ln.startswith("PEER_JSON ")]
    return json.loads(lines[-1][len("PEER_JSON "):]) if lines else None


def _peer_command(ctx: BenchContext, script: str, *options: str) -> list[str]:
    """A peer script's command line, with the suite's prompt, decode and prefill lengths."""
    return [sys.executable, str(BENCH_DIR / script), *options,
            "--prompt-tokens", str(ctx.args.prompt_tokens),
            "--decode-tokens", str(ctx.args.decode_tokens),
            "--prefill-tokens", str(ctx.args.prefill_tokens)]


def _run_peer(ctx: BenchContext, name: str, cmd: list[str], limit_s: float) -> tuple[dict, str]:
    """Run one peer script for at most limit_s and within the suite's deadline: (its
    PEER_JSON result or {"error"}, a note when the timeout cut a later stage)."""
    remaining_s = ctx.args.deadline_s - (time.perf_counter() - ctx.started_s)
    timeout_s = min(limit_s, remaining_s - 5)
    if timeout_s < 30:
        note = f"skipped: {remaining_s:.0f} s left of the suite's {ctx.args.deadline_s:.0f} s"
        ctx.log(f"  {name}: {note}")
        return {"error": note}, ""
    ctx.log(f"{name} (timeout {timeout_s:.0f} s): {' '.join(cmd[2:])}")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        return _peer_results(proc.stdout) or {"error": proc.stderr[-500:]}, ""
    except subprocess.TimeoutExpired as exc:
        result = _peer_results(exc.stdout) or {
            "error": f"skipped: over {timeout_s:.0f} s before the first stage ended"}
        return result, f"a later stage cut at {timeout_s:.0f} s; "


def _compare(ctx: BenchContext, name: str, result: dict, ours: dict[str, float],
             description: str) -> list[dict]:
    """A peer's decode and prefill rows (limit = our figure, so ratio = peer / ours, target
    1.0: beating the peer means ratio <= 1) and its TTFT."""
    rows = []
    for key, row, unit in (("decode_tok_s", "decode bs1", "tok/s"),
                           ("prefill_tok_s", f"prefill {ctx.args.prefill_tokens} tok", "tok/s")):
        peer = result[key]
        mine = ours.get(row)
        notes = f"{description}; ours/peer = " + (
            f"{mine / peer:.2f}" if mine and math.isfinite(peer) else "n/a")
        rows.append(figure(f"{name} {row}", peer, unit, mine, 1.0, notes,
                           higher_is_better=False))
        ctx.log(f"  {name} {row}: {peer:.1f} {unit} ({notes})")
    # Times: ratio = peer / ours, and beating the peer means ratio >= 1.
    rows.append(figure(f"{name} TTFT", result["ttft_ms"], "ms", ours.get("TTFT"), 1.0,
                       description))
    return rows


def peer_rows(ctx: BenchContext, label: str, ours: dict[str, float]) -> list[dict]:
    """Run the transformers peer for one model in a subprocess; compare with our figures."""
    if label not in ctx.args.peer_models:
        note = "skipped: not in --peer-models"
        return [figure(f"peer {label}", float("nan"), "-", notes=note)]
    cmd = _peer_command(ctx, "peer_transformers.py", "--model", label)
    if label not in ctx.args.peer_compile_models:
        cmd.append("--no-compile")
    result, cut = _run_peer(ctx, f"peer {label}", cmd, ctx.args.peer_timeout_s)
    if "error" in result:
        ctx.log(f"  peer {label}: {result['error']}")
        return [figure(f"peer {label}", float("nan"), "-", notes=result["error"])]
    mode = "static cache + compiled decode" if result.get("compiled") else "static cache eager"
    if "experts" in result:
        mode += f", experts {result['experts']}"
    rows = _compare(ctx, f"peer {label}", result, ours,
                    f"{cut}transformers {result['transformers']} {mode}")
    if "eager_decode_tok_s" in result:
        rows.insert(2, figure(f"peer {label} decode bs1 eager", result["eager_decode_tok_s"],
                              "tok/s"))
    return rows


def llamacpp_rows(ctx: BenchContext, label: str, ours: dict[str, float]) -> list[dict]:
    """llama.cpp's llama-bench on the same preset (llamacpp_peer.py), where --llama-bench
    names a build and the preset is a dense llama model."""
    name = f"peer llama.cpp {label}"
    cmd = _peer_command(ctx, "llamacpp_peer.py", "--llama-bench", ctx.args.llama_bench,
                        "--model", label)
    result, _ = _run_peer(ctx, name, cmd, ctx.args.llamacpp_timeout_s)
    if "error" in result:
        return [figure(name, float("nan"), "-", notes=result["error"])]
    return _compare(ctx, name, result, ours,
                    f"llama.cpp {result['llamacpp']} {result['backends']}, f16, flash attention")


def _our_best(figures: list[dict], label: str) -> dict[str, float]:
    """Our best figure per row of one model: the highest tok/s, and "TTFT", the lowest ms."""
    best: dict[str, float] = {}
    for f in figures:
        name = f["figure"]
        if not name.startswith(label + " "):
            continue
        short = name[len(label) + 1:].split(" [")[0]
        if f["unit"] == "tok/s":
            best[short] = max(best.get(short, 0.0), f["value"])
        elif short.startswith("TTFT"):
            best["TTFT"] = min(best.get("TTFT", math.inf), f["value"])
    return best


def hardware(device: torch.device) -> dict:
    import transformers

    info = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "transformers": transformers.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def run_bench(args: argparse.Namespace) -> dict:
    """Run the suite; returns the report (also written to args.out/bench.json)."""
    if not torch.cuda.is_available():
        raise SystemExit("strata bench: no CUDA GPU here; the speed suite needs an NVIDIA GPU")
    device = torch.device("cuda")
    ctx = BenchContext(args, device, {})
    ctx.log("measuring limits")
    ctx.limits = measure_limits(device)
    ctx.log("  " + ", ".join(f"{k} {v:.1f}" for k, v in ctx.limits.items()))
    for label in args.models:
        ctx.log(f"building {label} (random weights, bf16)")
        t0 = time.perf_counter()
        model = speed_rows.engine_model(label, device)
        torch.cuda.synchronize()
        ctx.log(f"  built in {time.perf_counter() - t0:.1f} s")
        for row in ROWS:
            try:
                ctx.figures += row(ctx, model, label)
            except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
                ctx.log(f"  {row.__name__} failed: {type(exc).__name__}: {exc}")
                ctx.figures.append(figure(f"{label} {row.__name__}", float("nan"),
                                                     "-", notes=f"FAILED {exc}"[:300]))
        del model
        torch.cuda.empty_cache()
        save_report(ctx)  # a later timeout keeps what was measured
    if not args.no_peer:
        for label in args.models:
            ours = _our_best(ctx.figures, label)
            ctx.figures += peer_rows(ctx, label, ours)
            if args.llama_bench and label in args.llamacpp_models:
                ctx.figures += llamacpp_rows(ctx, label, ours)
            save_report(ctx)
    if not args.no_lifecycle:
        torch.cuda.empty_cache()  # the scripts need the VRAM the speed rows' models held
        figures, ctx.lifecycle = lifecycle_rows(ctx)
        ctx.figures += figures
    report = save_report(ctx)
    print_table(report)
    return report


def save_report(ctx: BenchContext) -> dict:
    """Write args.out/bench.json with everything measured so far; returns the report."""
    report = {"benchmark": "speed", "command": " ".join(sys.argv),
              "hardware": hardware(ctx.device), "limits": ctx.limits,
              "params": dict(vars(ctx.args)), "figures": ctx.figures,
              "lifecycle": ctx.lifecycle,
              "total_s": time.perf_counter() - ctx.started_s}
    out = Path(ctx.args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"{hw['gpu']} | torch {hw['torch']} (CUDA {hw['torch_cuda']}) | "
          f"transformers {hw['transformers']} | triton {hw['triton']}")
    print(format_figures(report["figures"]))


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `strata bench` (shared by the CLI and this script)."""
    parser.add_argument("--out", default="bench-out", help="directory for bench.json")
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                        help="random-weight presets to run")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=4096)
    parser.add_argument("--long-prompt-tokens", type=int, default=32768,
                        help="the OOM check prompt on llama3-8b (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moe-impls", nargs="+", default=["triton", "bmm"],
                        help="MoE decode paths to measure (triton, bmm, loop)")
    parser.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    parser.add_argument("--peer-models", nargs="*", default=list(DEFAULT_MODELS),
                        help="models the transformers peer runs for (others: a skipped row)")
    # transformers' compiled decode is its fastest documented setup, so every peer tries it
    # after eager; on an H200 Llama-3-8B's took 54 s and Qwen3-30B-A3B's 91 s with its eager
    # stage (run9). When a timeout cuts the compiled stage, the eager figures stand.
    parser.add_argument("--peer-compile-models", nargs="*", default=list(DEFAULT_MODELS),
                        help="peers that also try transformers' compiled decode after eager")
    parser.add_argument("--peer-timeout-s", type=float, default=250.0)
    parser.add_argument("--deadline-s", type=float, default=600.0,
                        help="no peer starts that could end past this many seconds")
    parser.add_argument("--llama-bench", help="a llama-bench binary (bench/build_llamacpp.sh): "
                        "adds llama.cpp as a second peer")
    parser.add_argument("--llamacpp-models", nargs="*", default=["llama3-8b", "smollm2-135m"],
                        help="models the llama.cpp peer runs for (dense llama presets)")
    parser.add_argument("--llamacpp-timeout-s", type=float, default=300.0,
                        help="per llama.cpp peer: writing an 8B GGUF takes a minute or two "
                             "(raise --deadline-s too)")
    parser.add_argument("--no-lifecycle", action="store_true",
                        help="skip the lifecycle rows (release/refill, offload/restore, slot "
                             "switch, sleep/wake, partial expert cache, unload/load)")
    parser.add_argument("--lifecycle-model", default="qwen3-30b-a3b-mini",
                        help="lifecycle_bench.py's model")
    parser.add_argument("--unload-models", nargs="+", default=["smollm2-135m", "llama3-8b"],
                        help="unload_bench.py's models")
    parser.add_argument("--lifecycle-timeout-s", type=float, default=600.0,
                        help="per lifecycle script")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    run_bench(parser.parse_args())
    return 0


if __name__ == "__main__":
    sys.exit(main())
