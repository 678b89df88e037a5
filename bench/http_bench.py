"""HTTP benchmark: the real `strata serve` (default model, CPU) answering a streamed chat request.

    python bench/http_bench.py --compare docs/bench-results/cpu-inprocess.json \
        --json docs/bench-results/cpu-http.json

Starts the server as a subprocess (as the e2e tests do), times its start until the model is
loaded, then streams the same chat request as bench/cpu_bench.py through
/v1/chat/completions: time to first token and decode tok/s as a client sees them. With
--compare, the in-process figures of cpu_bench's JSON become the limit, so the ratio is the
cost of HTTP, tokenization, the pipe and detokenization.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

# The server subprocess helper lives with the e2e tests; the repository root makes it importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_bench import (
    DECODE_TOKENS,
    MEASURED_SLOTS,
    STORY_MESSAGES,
    figure,
    hardware_and_versions,
)
from report import format_figures, write_json  # bench/report.py, next to this file

from tests.e2e.server import ServerProcess
from tests.e2e.sse import chunk_text, sse_events


async def timed_stream(base_url: str, slot: int) -> dict:
    """One streamed chat completion: client-side TTFT and decode speed, and its usage."""
    body = {"messages": STORY_MESSAGES, "max_tokens": DECODE_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "strata_cache_slot": slot}
    stamps_s, usage = [], None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started_s = time.perf_counter()
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"the server answered {response.status}: "
                                   f"{await response.text()}")
            async for _, data in sse_events(response):
                if data == "[DONE]":
                    break
                if "error" in data:
                    raise RuntimeError(f"the stream failed: {data['error']}")
                if chunk_text(data):
                    stamps_s.append(time.perf_counter())
                usage = data.get("usage") or usage
    num_tokens = usage["completion_tokens"]
    decode_s = stamps_s[-1] - stamps_s[0]
    return {
        "ttft_s": stamps_s[0] - started_s,
        "decode_tok_s": (num_tokens - 1) / decode_s if num_tokens > 1 and decode_s > 0 else 0.0,
        "completion_tokens": num_tokens,
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        "num_chunks": len(stamps_s),
    }


def engine_load_info(status: dict) -> dict:
    """The engine's load info (model_type, load_time_s, ...) from /v1/status."""
    engine = status.get("engine") or {}
    return engine.get("model_info") or engine  # nested since the lifecycle work, flat before


def in_process_figure(path: str | None, name: str) -> float | None:
    """A figure's value from a cpu_bench JSON report, to compare against."""
    if not path:
        return None
    report = json.loads(Path(path).read_text())
    return next(f["value"] for f in report["figures"] if f["figure"] == name)


def run(args: argparse.Namespace) -> dict:
    hardware = hardware_and_versions()
    with tempfile.TemporaryDirectory(prefix="strata-http-bench-") as tmp:
        server = ServerProcess(Path(tmp))
        started_s = time.perf_counter()
        server.start()
        ready_s = time.perf_counter() - started_s
        try:
            engine_info = engine_load_info(server.status())
            asyncio.run(timed_stream(server.base_url, 0))  # warm-up
            runs = [asyncio.run(timed_stream(server.base_url, slot)) for slot in MEASURED_SLOTS]
        finally:
            server.stop()
    ttft_ms = statistics.median(r["ttft_s"] for r in runs) * 1e3
    decode_tok_s = statistics.median(r["decode_tok_s"] for r in runs)
    figures = [
        figure("server start until loaded", ready_s, "s"),
        figure("engine load in the server", float(engine_info.get("load_time_s", 0.0)), "s"),
        # ratio: HTTP over in-process; above 1 for TTFT, below 1 for decode is the overhead.
        figure("chat TTFT via HTTP (median)", ttft_ms, "ms",
               in_process_figure(args.compare, "chat TTFT (median)")),
        figure("chat decode via HTTP (median)", decode_tok_s, "tok/s",
               in_process_figure(args.compare, "chat decode (median)")),
    ]
    hardware["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    return {
        "benchmark": "cpu_http",
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "hardware": hardware,
        "params": {"server": "strata serve --device cpu --context 2048",
                   "decode_max_tokens": DECODE_TOKENS, "compared_with": args.compare},
        "figures": figures,
        "raw": {"runs": runs, "engine": engine_info},
    }


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"{hw['cpu']} | {hw['cores']} cores | load {hw['load_average_1m']} -> "
          f"{hw['load_average_1m_end']} | strata {hw['strata']}, aiohttp {hw['aiohttp']}")
    print(format_figures(report["figures"], limit_header="in-proc"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", help="a cpu_bench.py JSON report to compare with")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = run(args)
    print_table(report)
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
