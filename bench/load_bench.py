"""How fast a model is ready: in a fresh engine process, in a standby one, and back after an
unload (issue 18 item 6), through the real Supervisor and engine processes.

    python bench/load_bench.py [MODEL_PATH | --preset smollm2-135m] [--runs 3] [--timeout 110]
                               [--context-tokens 4096] [--env NAME=VALUE ...] --json load.json

MODEL_PATH: a GGUF file or Hugging Face directory (default: the embedded default model, which
must be downloaded: `strata pull`). --preset NAME instead writes that random-weight preset as
an f16 GGUF (random_gguf.py) into a temporary directory, for a machine without the model.
Each run measures, in order:
- fresh: spawn an engine process (import torch, ...), load, to ready (the Load reply) and to
  the first token of a 16-token prompt;
- unload -> load back: unload (the process exits), a standby process started right behind
  it as the server does, and load into it at once, from the unload's start to ready/token;
- standby: unload, start a standby, wait until it has imported everything it will
  (`is_warm`), then load into it, to ready and to the first token.
Each scenario's row prints as soon as it is measured; --timeout S starts no further run once
the next would likely end past S seconds (the report covers the runs made).
The engine reports each load's seconds per phase (cuda_init, read_file, map_weights, ...;
load_phases.py) and whether its prefill tuning was measured or read from the kernel cache
(fast/tuning_store.py), whether its prefill groups compiled at load or after it ("deferred":
fast/deferred_compile.py) and whether the decode kernels were checked or their verdicts read;
the table prints them per row. The first run of a machine may fill
the kernel caches; later runs show what a user's loads cost. --env sets a variable for the
engine processes (e.g. TORCH_CACHING_PRECOMPILE=1 to try torch's experimental precompile
cache). Target: ready <= 2 s from the standby; unload -> load back <= the fresh load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import figure, format_figures, write_json  # bench/report.py, next to this file

from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.load_phases import PHASE_NAMES
from strata.engine.protocol import SamplingSpec
from strata.engine.service.supervisor import Supervisor

STANDBY_READY_TARGET_S = 2.0
PROMPT = list(range(10, 26))  # 16 token ids every vocabulary has


async def first_token(supervisor: Supervisor) -> None:
    """Run a 16-token prompt until its first generated token."""
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    async for event in supervisor.stream("bench", PROMPT, spec):
        if getattr(event, "token_ids", None):
            break


async def timed_load(supervisor: Supervisor, started_s: float) -> dict:
    """ensure_loaded, then one token; seconds from started_s to each, and the load's info."""
    info = await supervisor.ensure_loaded()
    ready_s = time.perf_counter() - started_s
    await first_token(supervisor)
    return {"ready_s": ready_s, "first_token_s": time.perf_counter() - started_s,
            "tuning": info.get("tuning"), "load_time_s": info.get("load_time_s"),
            "compile": info.get("compile"), "kernel_check": info.get("kernel_check"),
            "phases_s": info.get("load_phases_s", {})}


async def wait_for_warm_standby(supervisor: Supervisor, timeout_s: float = 120.0) -> float:
    """Seconds until the standby has imported what it will (`is_warm`: its imports run on a
    thread while it already answers, process.py)."""
    started_s = time.perf_counter()
    while time.perf_counter() - started_s < timeout_s:
        status = await supervisor.standby_status()
        if status is None:
            raise SystemExit("the standby process exited; see the engine's log above")
        if status.engine.standby.get("is_warm", True):
            break
        await asyncio.sleep(0.1)
    return time.perf_counter() - started_s


def print_row(scenario: str, row: dict) -> None:
    """One scenario's figures as soon as they are measured (a run cut short still shows)."""
    phases = {k.removesuffix("_s"): v for k, v in row["phases_s"].items() if v >= 0.005}
    print(f"    {scenario}: ready {row['ready_s']:.2f} s, first token "
          f"{row['first_token_s']:.2f} s, tuning {row['tuning']}, compile {row['compile']}, "
          f"kernel check {row['kernel_check']}; phases "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)


async def one_run(config: EngineConfig) -> dict[str, dict]:
    supervisor = Supervisor(config, load_timeout_s=900)
    rows: dict[str, dict] = {}
    try:
        rows["fresh"] = await timed_load(supervisor, time.perf_counter())
        print_row("fresh", rows["fresh"])

        started_s = time.perf_counter()
        await supervisor.stop()
        unload_s = time.perf_counter() - started_s
        await supervisor.start_standby()
        rows["unload -> load back"] = {**await timed_load(supervisor, started_s),
                                       "unload_s": unload_s}
        print_row("unload -> load back", rows["unload -> load back"])

        await supervisor.stop()
        await supervisor.start_standby()
        warm_s = await wait_for_warm_standby(supervisor)
        await asyncio.sleep(0.5)  # an idle standby, as a user's would be
        rows["standby"] = {**await timed_load(supervisor, time.perf_counter()),
                           "standby_imports_s": warm_s}
        print_row("standby", rows["standby"])
    finally:
        await supervisor.stop()
        await supervisor.stop_standby()
    return rows


def phase_table(runs: list[dict[str, dict]]) -> str:
    """One line per run and scenario: ready, first token, tuning source, every phase."""
    names = [f"{name}_s" for name in PHASE_NAMES] + ["other_s"]
    short = [n.removesuffix("_s") for n in names]
    header = f"{'run':>3} {'scenario':22} {'ready':>7} {'token':>7} {'tuning':9} " + \
        " ".join(f"{s[:12]:>12}" for s in short)
    lines = [header, "(seconds)"]
    for index, rows in enumerate(runs, 1):
        for scenario, row in rows.items():
            phases = row["phases_s"]
            cells = " ".join(f"{phases.get(n, 0.0):>12.3f}" for n in names)
            lines.append(f"{index:>3} {scenario:22} {row['ready_s']:>7.2f} "
                         f"{row['first_token_s']:>7.2f} {row['tuning']!s:9} {cells}")
    return "\n".join(lines)


def summary_figures(runs: list[dict[str, dict]]) -> list[dict]:
    """Medians over the runs; the first run is listed on its own too (it may have filled the
    kernel caches)."""
    def median(scenario: str, field: str) -> float:
        return statistics.median(rows[scenario][field] for rows in runs)

    fresh_s = median("fresh", "ready_s")
    figures = [
        figure("first run: fresh process to ready", runs[0]["fresh"]["ready_s"], "s"),
        figure("fresh process to ready", fresh_s, "s"),
        figure("fresh process to first token", median("fresh", "first_token_s"), "s"),
        figure("unload -> load back to ready", median("unload -> load back", "ready_s"), "s",
               fresh_s, 1.0, higher_is_better=False,
               notes="limit: the fresh load's ready"),
        figure("unload -> load back to first token",
               median("unload -> load back", "first_token_s"), "s"),
        figure("unload (engine process gone)", median("unload -> load back", "unload_s"), "s"),
        figure("standby imports (idle, off the load's path)",
               median("standby", "standby_imports_s"), "s"),
        figure("standby process to ready", median("standby", "ready_s"), "s",
               STANDBY_READY_TARGET_S, 1.0, higher_is_better=False),
        figure("standby process to first token", median("standby", "first_token_s"), "s",
               STANDBY_READY_TARGET_S, 1.0, higher_is_better=False),
    ]
    for name in PHASE_NAMES:
        seconds = statistics.median(rows["standby"]["phases_s"].get(f"{name}_s", 0.0)
                                    for rows in runs)
        figures.append(figure(f"standby load phase: {name}", seconds, "s"))
    return figures


def hardware() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():  # the bench's own process: no engine shares it
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="GGUF file or HF directory (default: the "
                        "embedded default model)")
    parser.add_argument("--preset", help="bench a random-weight preset written as a GGUF "
                        "(e.g. smollm2-135m, the default model's shape) instead")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=110.0, metavar="S",
                        help="start no further run once the next would likely end past S "
                        "seconds (each run's rows print as they are measured)")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set for the engine processes (repeatable)")
    parser.add_argument("--kernel-cache", metavar="DIR", help="the engines' kernel cache "
                        "(compiled kernels, autotune picks, tuning results) under DIR; an empty "
                        "DIR makes the first run compile and tune everything")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if args.model and args.preset:
        parser.error("give a MODEL_PATH or --preset, not both")
    with tempfile.TemporaryDirectory(prefix="strata-load-bench-") as work_dir:
        if args.preset:
            from random_gguf import write_random_gguf  # next to this file

            args.model = str(Path(work_dir) / f"{args.preset}.gguf")
            write_random_gguf(args.preset, args.model)
        elif args.model is None:
            from strata.default_model import default_model_path

            args.model = str(default_model_path(fetch=False))
        return bench(args)


def bench(args: argparse.Namespace) -> int:
    if args.kernel_cache:  # as strata.paths.kernel_cache_dir and process.py would set them
        kernels = Path(args.kernel_cache).resolve() / "strata" / "kernels"
        os.environ.update(XDG_CACHE_HOME=str(kernels.parents[1]),
                          TORCHINDUCTOR_CACHE_DIR=str(kernels / "inductor"),
                          TRITON_CACHE_DIR=str(kernels / "triton"))
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env takes NAME=VALUE, not {item!r}")
        os.environ[name] = value  # spawned engine processes inherit it
    config = EngineConfig(model_path=args.model, device=args.device,
                          context_tokens=args.context_tokens)
    runs = []
    started_s = time.perf_counter()
    for index in range(args.runs):
        if runs and time.perf_counter() - started_s > args.timeout * (1 - 1 / (len(runs) + 1)):
            # The next run would likely end past the budget: report what was measured.
            print(f"  stopping after {len(runs)} runs: --timeout {args.timeout:.0f} s",
                  flush=True)
            break
        print(f"  run {index + 1} of {args.runs}", flush=True)
        runs.append(asyncio.run(one_run(config)))
    figures = summary_figures(runs)
    report = {"benchmark": "load", "hardware": hardware(),
              "params": {"model": args.preset or args.model, "runs": len(runs),
                         "context_tokens": args.context_tokens, "env": args.env,
                         "kernel_cache": args.kernel_cache},
              "figures": figures, "runs": runs}
    print(" | ".join(f"{k} {v}" for k, v in report["hardware"].items()))
    print(phase_table(runs))
    print(format_figures(figures))
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
