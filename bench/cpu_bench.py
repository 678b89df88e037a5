"""CPU benchmark of the default model (SmolLM2-135M-Instruct Q4_1) through the in-process Engine.

    python bench/cpu_bench.py --json docs/bench-results/cpu-inprocess.json

Measures: load time (text assets, engine load), prompt processing tok/s (a cold prompt of
--prompt-tokens), time to first token and decode tok/s of the chat request that
bench/http_bench.py sends through the real server, and the memory-bandwidth roofline of decode
(every fp32 weight is read once per token, at the measured read bandwidth). Prints a table and
writes JSON (hardware, versions, figure, limit, ratio), like bench/arena_bench.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from importlib import metadata

from report import format_figures, write_json  # bench/report.py, next to this file

# Shared with http_bench.py so both measure the very same request.
STORY_MESSAGES = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
DECODE_TOKENS = 128
# Slot 0 warms up; each measured run uses a slot never used before, so its prompt is cold.
MEASURED_SLOTS = (1, 2, 3)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hardware_and_versions() -> dict:
    """CPU, cores, memory, load and the versions of what the figures depend on."""
    import torch

    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_bytes"] = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for package in ("strata", "torch", "gguf", "tokenizers", "numpy", "aiohttp"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = "not installed"
    return info


def read_bandwidth_gb_s(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Best read bandwidth of a torch sum over a buffer larger than the caches: the limit
    of decode, which streams every weight once per token."""
    import torch

    values = torch.ones(num_bytes // 4, dtype=torch.float32)
    values.sum()  # touch the pages first
    best_s = min(_timed(values.sum) for _ in range(repeats))
    return num_bytes / best_s / 1e9


def _timed(fn) -> float:
    started_s = time.perf_counter()
    fn()
    return time.perf_counter() - started_s


def figure(name: str, value: float, unit: str, limit: float | None = None) -> dict:
    ratio = value / limit if limit else None
    return {"figure": name, "value": value, "unit": unit, "limit": limit, "ratio": ratio}


def timed_generation(engine, prompt_ids: list[int], sampling, slot: int) -> dict:
    """One generation: time to first token, decode tok/s after it, and the engine's usage."""
    started_s = time.perf_counter()
    stamps_s = []
    for _ in engine.generate(prompt_ids, sampling, slot=slot):
        stamps_s.append(time.perf_counter())
    usage = engine.last_usage
    num_tokens = usage.completion_tokens
    decode_s = stamps_s[-1] - stamps_s[0]
    return {
        "ttft_s": stamps_s[0] - started_s,
        "decode_tok_s": (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0,
        "completion_tokens": num_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.cached_tokens,
    }


def cold_prompt(assets, num_tokens: int, first_token: int) -> list[int]:
    """`num_tokens` ids of ordinary text, starting with a token no other run starts with."""
    text = ("The history of the city begins with a small market by the river, where traders "
            "from the hills met fishermen from the coast. ") * (num_tokens // 10 + 1)
    return [first_token, *assets.encode(text)[: num_tokens - 1]]


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from strata.default_model import default_model_path
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec
    from strata.engine.text import load_text_assets

    model_path = str(args.model or default_model_path(fetch=True))
    hardware = hardware_and_versions()
    assets_s = _timed(lambda: load_text_assets(model_path))
    assets = load_text_assets(model_path)
    load_s = []
    for _ in range(args.loads):
        engine = Engine(EngineConfig(model_path=model_path, device="cpu",
                                     context_tokens=args.context))
        load_s.append(_timed(engine.load))
        if len(load_s) < args.loads:
            engine.close()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())

    # Prompt processing: a cold prompt per run (its own first token, cached_tokens 0).
    one_token = SamplingSpec(max_tokens=1, temperature=0.0)
    prefill = []
    for run_index, slot in enumerate((0, *MEASURED_SLOTS)):
        prompt = cold_prompt(assets, args.prompt_tokens, first_token=1000 + run_index)
        result = timed_generation(engine, prompt, one_token, slot)
        assert result["cached_tokens"] == 0, result
        prefill.append(args.prompt_tokens / result["ttft_s"])
    prefill = prefill[1:]  # the first run warms up

    # The chat request http_bench.py sends; new slots keep each prompt cold.
    chat_ids = assets.encode_chat(STORY_MESSAGES)
    sampling = SamplingSpec(max_tokens=DECODE_TOKENS, temperature=0.0,
                            stop_token_ids=tuple(assets.eos_token_ids))
    for slot in (0, *MEASURED_SLOTS):
        engine.erase_slot(slot)
    timed_generation(engine, chat_ids, sampling, 0)  # warm-up
    chats = [timed_generation(engine, chat_ids, sampling, slot) for slot in MEASURED_SLOTS]
    engine.close()

    bandwidth_gb_s = read_bandwidth_gb_s()
    decode_limit_tok_s = bandwidth_gb_s * 1e9 / weight_bytes
    figures = [
        figure("text assets (tokenizer) load", assets_s, "s"),
        # The first load pays imports, page cache and allocator warm-up; later ones are warm.
        figure("engine load, first in the process", load_s[0], "s"),
        *([figure("engine load, again (median)", statistics.median(load_s[1:]), "s")]
          if len(load_s) > 1 else []),
        figure(f"prompt processing, {args.prompt_tokens} tok (median)",
               statistics.median(prefill), "tok/s"),
        figure("chat TTFT (median)", statistics.median(c["ttft_s"] for c in chats) * 1e3, "ms"),
        figure("chat decode (median)", statistics.median(c["decode_tok_s"] for c in chats),
               "tok/s", decode_limit_tok_s),
        figure("memory read bandwidth (torch sum)", bandwidth_gb_s, "GB/s"),
    ]
    hardware["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return {
        "benchmark": "cpu_inprocess",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": hardware,
        "params": {"model": model_path, "context_tokens": args.context,
                   "prompt_tokens": args.prompt_tokens, "decode_max_tokens": DECODE_TOKENS,
                   "chat_prompt_tokens": len(chat_ids), "weight_bytes": weight_bytes,
                   "dtype": "float32"},
        "figures": figures,
        "raw": {"load_s": load_s, "prefill_tok_s": prefill, "chat_runs": chats},
    }


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"{hw['cpu']} | {hw['cores']} cores, {hw['torch_threads']} torch threads, "
          f"OMP_WAIT_POLICY={hw['omp_wait_policy']} | load {hw['load_average_1m']} -> "
          f"{hw['load_average_1m_end']} | torch {hw['torch']}, strata {hw['strata']}")
    print(format_figures(report["figures"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2-135M)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="cold prompt length")
    parser.add_argument("--context", type=int, default=2048, help="engine context tokens")
    parser.add_argument("--loads", type=int, default=2, help="engine loads to time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    if args.prompt_tokens < 2 or args.prompt_tokens >= args.context:
        parser.error(f"--prompt-tokens must be 2..{args.context - 1} (below --context)")
    report = run(args)
    print_table(report)
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
