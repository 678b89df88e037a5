"""Unload and load through the real Supervisor and engine process, measured with NVML.

    python bench/unload_bench.py --json out.json [--models smollm2-135m llama3-8b]
                                 [--random-weights] [--work-dir DIR]

For each model: a cold start (spawn, import torch, CUDA init, load the weights) to the first
token; unload (the engine process exits) until NVML shows the GPU's used memory back at the
baseline measured before the engine started; then a load from a standby process (torch
already imported, no CUDA context) to the first token. DESIGN §8: unload back to the baseline
in <= 0.5 s.

By default (--from-file) each preset is first written as a bf16 Hugging Face directory
(random_hf_dir.py) into a temporary directory and read once, so the loads below read it from
the OS page cache, as for a user who loaded that model before: this is what a real load costs.
--random-weights instead draws the weights on the GPU (no file at all), which hides the
loader. The temporary directory is deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from random_hf_dir import warm_page_cache, write_random_hf_dir  # next to this file
from report import figure, format_figures, write_json  # bench/report.py, next to this file

from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.memory.vram import nvml_unavailable_reason, read_vram_info
from strata.engine.protocol import SamplingSpec
from strata.engine.service.supervisor import Supervisor

UNLOAD_TARGET_S = 0.5
BASELINE_SLACK_BYTES = 64 << 20  # NVML's own bookkeeping moves by a few MiB


def used_vram_bytes() -> int:
    """Device-wide used VRAM of GPU 0 (strata's NVML reader; every process counts)."""
    info = read_vram_info(0)
    if info is None:
        raise SystemExit("NVML cannot read the GPU's memory here: " + str(nvml_unavailable_reason()))
    return info.used_bytes


class BaselineWatcher(threading.Thread):
    """Polls NVML every 2 ms from its own thread and notes when used VRAM first falls to
    `limit_bytes`: the VRAM is back when the driver says so, which may be before the engine
    process has finished exiting (tearing down its host memory), and that is what the target
    is about."""

    def __init__(self, limit_bytes: int):
        super().__init__(daemon=True)
        self.limit_bytes = limit_bytes
        self.reached_s: float | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            if used_vram_bytes() <= self.limit_bytes:
                self.reached_s = time.perf_counter()
                return
            time.sleep(0.002)

    def wait(self, timeout_s: float) -> float:
        """When the baseline was reached (perf_counter seconds); now if it never was."""
        self.join(timeout_s)
        self._stop_event.set()
        return self.reached_s if self.reached_s is not None else time.perf_counter()


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


def available_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def prepare_model_dir(name: str, root: Path) -> Path:
    """Write preset `name` as a Hugging Face directory under root and leave it in the page
    cache. Written from a child process, so this one never holds a CUDA context."""
    directory = root / name
    started_s = time.perf_counter()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        written_bytes = pool.submit(write_random_hf_dir, name, directory).result()
    os.sync()  # written back now, not while a load is being timed
    available = available_ram_bytes()
    if available is not None and 2 * written_bytes > available:
        print(f"  warning: {written_bytes / 1e9:.1f} GB of weights with {available / 1e9:.1f} "
              "GB of RAM available: the page cache may not hold them through the load",
              flush=True)
    warm_page_cache(directory)
    print(f"  {name}: {written_bytes / 1e9:.2f} GB written and read in "
          f"{time.perf_counter() - started_s:.1f} s", flush=True)
    return directory


async def bench_model(name: str, figures: list[dict], model_dir: Path | None) -> None:
    """Measure one preset; from model_dir (a Hugging Face directory) or random weights (None)."""
    from strata.engine.core.random_weights import random_weights_config

    vocab_size = random_weights_config(name).vocab_size
    baseline = used_vram_bytes()
    if model_dir is None:
        source = "random weights"
        config = EngineConfig(model_path=f"random:{name}", device="cuda", random_weights=name,
                              context_tokens=4096)
    else:
        source = "from the page cache"
        config = EngineConfig(model_path=str(model_dir), device="cuda", context_tokens=4096)
    supervisor = Supervisor(config, load_timeout_s=600)
    try:
        cold_s = await first_token_s(supervisor, vocab_size)
        loaded = used_vram_bytes()
        watcher = BaselineWatcher(baseline + BASELINE_SLACK_BYTES)
        started_s = time.perf_counter()
        watcher.start()
        await supervisor.stop()
        stop_s = time.perf_counter() - started_s
        unload_s = watcher.wait(30.0) - started_s
        after = used_vram_bytes()
        await supervisor.start_standby()
        await asyncio.sleep(8)  # let the standby finish importing torch, as it would when idle
        warm_s = await first_token_s(supervisor, vocab_size)
    finally:
        await supervisor.stop()
        await supervisor.stop_standby()
    mib = 1 << 20
    figures += [
        figure(f"{name} cold start to first token ({source})", cold_s, "s"),
        figure(f"{name} VRAM held while loaded", (loaded - baseline) / mib, "MiB"),
        figure(f"{name} unload to baseline VRAM", unload_s, "s", UNLOAD_TARGET_S, 1.0,
               higher_is_better=False),
        figure(f"{name} unload until the engine process has exited", stop_s, "s"),
        figure(f"{name} VRAM above baseline after unload", (after - baseline) / mib, "MiB"),
        figure(f"{name} load from standby to first token ({source})", warm_s, "s"),
    ]


async def run(args: argparse.Namespace) -> dict:
    import torch

    figures: list[dict] = []
    root = None if args.random_weights else Path(
        tempfile.mkdtemp(prefix="strata-unload-bench-", dir=args.work_dir)
    )
    try:
        for name in args.models:
            model_dir = None if root is None else prepare_model_dir(name, root)
            await bench_model(name, figures, model_dir)
            if model_dir is not None:
                shutil.rmtree(model_dir)  # one model on disk at a time
            print(f"  {name} done", flush=True)
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "unload",
        "hardware": {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__},
        "params": {"models": args.models,
                   "weights": "random" if args.random_weights else "file (page cache)"},
        "figures": figures,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama3-8b"])
    parser.add_argument("--json", help="write the report here")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--from-file", dest="random_weights", action="store_false",
                        help="load bf16 safetensors written once and left in the page cache "
                        "(the default)")
    source.add_argument("--random-weights", dest="random_weights", action="store_true",
                        help="draw the weights on the GPU instead of reading a file")
    parser.set_defaults(random_weights=False)  # two actions share the dest: say which wins
    parser.add_argument("--work-dir", help="where the temporary model directories go "
                        "(default: the system temp dir; llama3-8b needs 16 GB)")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(f"{report['hardware']['gpu']} | torch {report['hardware']['torch']}")
    print(format_figures(report["figures"]))
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
