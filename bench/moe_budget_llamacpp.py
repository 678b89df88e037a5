"""moe_budget_bench.py's peer: llama-bench on the same file with `-ncmoe` chosen to fit each
budget (the first ncmoe layers' experts computed on the CPU), its command, environment and
JSON."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import TYPE_CHECKING

from report import write_json

if TYPE_CHECKING:
    from moe_budget_bench import BudgetPlan


def llamacpp_command(args, plan: BudgetPlan) -> list[str]:
    """llama-bench on the same file: every layer on the GPU except the first ncmoe layers'
    experts, flash attention, one prompt of --prefill-tokens and --decode-tokens generated."""
    return [args.llama_bench, "-m", str(args.gguf), "-p", str(args.prefill_tokens),
            "-n", str(args.decode_tokens), "-ngl", "99", "-ncmoe", str(plan.ncmoe), "-fa", "1",
            "-ub", str(args.ubatch), "-b", str(max(args.ubatch, args.prefill_tokens)),
            "-r", str(args.llamacpp_repeats), "-o", "json"]


def parse_llama_bench(stdout: str, prefill_tokens: int, decode_tokens: int) -> dict:
    """{prefill_tok_s, decode_tok_s, llamacpp, backends} from llama-bench's JSON list."""
    tests = json.loads(stdout[stdout.index("["):])
    rate = {(t["n_prompt"], t["n_gen"]): t["avg_ts"] for t in tests}
    missing = [k for k in ((prefill_tokens, 0), (0, decode_tokens)) if k not in rate]
    if missing:
        raise ValueError(f"llama-bench gave no result for (prompt, generated) {missing}: {rate}")
    return {"prefill_tok_s": rate[(prefill_tokens, 0)], "decode_tok_s": rate[(0, decode_tokens)],
            "llamacpp": f"{tests[0].get('build_commit', '?')} "
                        f"(build {tests[0].get('build_number', '?')})",
            "backends": tests[0].get("backends", "")}


def llama_bench_env(args) -> dict:
    """The environment llama-bench runs in: torch's CUDA libraries on LD_LIBRARY_PATH, as
    peer_run.py gives a binary built elsewhere (bench/build_llamacpp.sh with CUDA_ROOT)."""
    from peer_run import cuda_library_dirs

    dirs = [*cuda_library_dirs(), *filter(None, [os.environ.get("LD_LIBRARY_PATH")])]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(dirs)}


def llamacpp_rows(args, plans: list[BudgetPlan], report: dict) -> None:
    """llama-bench per budget; results in report["llamacpp"][label]. Run before Strata's rows:
    they are bounded, and without them no row has a ratio."""
    peer: dict = report.setdefault("llamacpp", {})
    env = llama_bench_env(args)
    for plan in plans:
        command = llamacpp_command(args, plan)
        left_s = args.deadline - time.monotonic()
        if left_s < 20:
            peer[plan.label] = {"skipped": "deadline", "command": " ".join(command)}
            continue
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False,
                                  timeout=left_s, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr[-600:]}")
            row = parse_llama_bench(done.stdout, args.prefill_tokens, args.decode_tokens)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            row = {"error": str(exc)[-800:]}
        peer[plan.label] = row | {"command": " ".join(command), "ncmoe": plan.ncmoe}
        print(f"llama.cpp {plan.label}: {json.dumps(peer[plan.label])}", flush=True)
        write_json(report, args.json)
