"""Unload and load through the real Supervisor and engine process, measured with NVML.

    python bench/unload_bench.py --json out.json [--models smollm2-135m llama3-8b]

For each random-weight model: a cold start (spawn, import torch, CUDA init, build the weights)
to the first token; unload (the engine process exits) until NVML shows the GPU's used memory
back at the baseline measured before the engine started; then a load from a standby process
(torch already imported, no CUDA context) to the first token. DESIGN §8: unload back to the
baseline in <= 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import format_figures, write_json  # bench/report.py, next to this file

from strata.engine.core.engine_config import EngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.service.supervisor import Supervisor

UNLOAD_TARGET_S = 0.5
BASELINE_SLACK_BYTES = 64 << 20  # NVML's own bookkeeping moves by a few MiB


def used_vram_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


async def first_token_s(supervisor: Supervisor, vocab_size: int) -> float:
    """Seconds from asking to load (if needed) to the first generated token."""
    started_s = time.perf_counter()
    await supervisor.ensure_loaded()
    prompt = [random.randrange(vocab_size) for _ in range(16)]
    spec = SamplingSpec(max_tokens=1, temperature=0.0)
    async for event in supervisor.stream("bench", prompt, spec):
        if getattr(event, "token_ids", None):
            break
    return time.perf_counter() - started_s


async def bench_model(name: str, figures: list[dict]) -> None:
    from strata.engine.core.random_weights import random_weights_config

    vocab_size = random_weights_config(name).vocab_size
    baseline = used_vram_bytes()
    config = EngineConfig(model_path=f"random:{name}", device="cuda", random_weights=name,
                          context_tokens=4096)
    supervisor = Supervisor(config, load_timeout_s=600)
    try:
        cold_s = await first_token_s(supervisor, vocab_size)
        loaded = used_vram_bytes()
        started_s = time.perf_counter()
        await supervisor.stop()
        while used_vram_bytes() > baseline + BASELINE_SLACK_BYTES:
            if time.perf_counter() - started_s > 30:
                break
            await asyncio.sleep(0.005)
        unload_s = time.perf_counter() - started_s
        after = used_vram_bytes()
        await supervisor.start_standby()
        await asyncio.sleep(8)  # let the standby finish importing torch, as it would when idle
        warm_s = await first_token_s(supervisor, vocab_size)
    finally:
        await supervisor.stop()
        await supervisor.stop_standby()
    mib = 1 << 20
    figures += [
        {"figure": f"{name} cold start to first token", "value": cold_s, "unit": "s",
         "limit": None, "ratio": None},
        {"figure": f"{name} VRAM held while loaded", "value": (loaded - baseline) / mib,
         "unit": "MiB", "limit": None, "ratio": None},
        {"figure": f"{name} unload to baseline VRAM", "value": unload_s, "unit": "s",
         "limit": UNLOAD_TARGET_S, "ratio": unload_s / UNLOAD_TARGET_S},
        {"figure": f"{name} VRAM above baseline after unload", "value": (after - baseline) / mib,
         "unit": "MiB", "limit": None, "ratio": None},
        {"figure": f"{name} load from standby to first token", "value": warm_s, "unit": "s",
         "limit": None, "ratio": None},
    ]


async def run(args: argparse.Namespace) -> dict:
    import torch

    figures: list[dict] = []
    for name in args.models:
        await bench_model(name, figures)
        print(f"  {name} done", flush=True)
    return {
        "benchmark": "unload",
        "hardware": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "params": {"models": args.models},
        "figures": figures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(f"{report['hardware']['gpu']} | torch {report['hardware']['torch']}")
    print(format_figures(report["figures"]))
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
