"""The lifecycle rows of `strata bench`: lifecycle_bench.py and unload_bench.py, each in a
subprocess with a timeout, their figures added to the suite's table.

A subprocess each, because the lifecycle engines take and give back tens of GiB of VRAM and
pinned RAM, and the unload bench spawns engine processes and measures the GPU's used memory
against a baseline: neither must share a process with the speed rows' models. A script that
fails or runs out of time costs its rows (one failed row says why), never the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from report import figure

BENCH_DIR = Path(__file__).resolve().parent


def scripts(args) -> list[tuple[str, list[str]]]:
    """(name, arguments after the script path) of each lifecycle script to run."""
    return [
        ("lifecycle", ["lifecycle_bench.py", "--model", args.lifecycle_model]),
        ("unload", ["unload_bench.py", "--models", *args.unload_models]),
    ]


def run_script(ctx, name: str, argv: list[str]) -> tuple[list[dict], dict | None]:
    """Run one script; (its figures, its whole report) or ([a failed row], None)."""
    out = Path(ctx.args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, log_path = out / f"{name}.json", out / f"{name}.log"
    command = [sys.executable, str(BENCH_DIR / argv[0]), *argv[1:], "--json", str(json_path)]
    ctx.log(f"{name} (timeout {ctx.args.lifecycle_timeout_s:.0f} s): {' '.join(argv)}")
    json_path.unlink(missing_ok=True)
    try:
        with log_path.open("w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=ctx.args.lifecycle_timeout_s, check=False)
        why = None if done.returncode == 0 else f"exit status {done.returncode}"
    except subprocess.TimeoutExpired:
        why = f"no result within {ctx.args.lifecycle_timeout_s:.0f} s"
    if why is None and json_path.is_file():
        report = json.loads(json_path.read_text())
        return report["figures"], report
    note = f"FAILED: {why or 'no JSON written'}; see {log_path}"
    ctx.log(f"  {name} {note}")
    return [figure(f"{name} bench", float("nan"), "-", notes=note)], None


def lifecycle_rows(ctx) -> tuple[list[dict], dict]:
    """Every lifecycle script's figures, and their reports by name (JSON's `lifecycle`)."""
    figures, reports = [], {}
    for name, argv in scripts(ctx.args):
        rows, report = run_script(ctx, name, argv)
        figures += rows
        reports[name] = report
    return figures, reports
