"""What the rules' process watcher costs, and how fast it sees a new process.

    python bench/process_watch_bench.py [--seconds 20] [--spawns 20] [--json out.json]

Runs the ProcessWatcher (strata/engine/service/process_watch.py) at its 100 ms tick in its
thread for --seconds and reports the CPU time this process spent per second of wall time (% of
one core; the bench does nothing else meanwhile), with the number of processes running. Then
spawns --spawns short Python processes, one every 0.3 s, and reports how long after Popen
returned the watcher saw each (ms; the target is 250 ms, DESIGN §7).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata
from report import figure, format_figures, write_json  # bench/report.py, next to this file

from strata.engine.service.process_watch import INTERVAL_S, ProcessWatcher


def cpu_cost(seconds: float) -> tuple[float, int, int]:
    """(% of one core, processes running, ticks) of the watcher alone over `seconds`."""
    watcher = ProcessWatcher()
    watcher.scan()  # the first tick reads every process once: not the steady state
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    ticks_before = watcher.num_ticks
    watcher.start()
    time.sleep(seconds)
    watcher.stop()
    cpu_s, wall_s = time.process_time() - cpu_before, time.perf_counter() - wall_before
    return 100.0 * cpu_s / wall_s, len(watcher.known), watcher.num_ticks - ticks_before


def detection_ms(num_spawns: int) -> list[float]:
    """Time from Popen's return to the watcher's event for each of num_spawns processes."""
    watcher = ProcessWatcher()
    seen: dict[int, float] = {}
    lock = threading.Lock()

    def on_events(events):
        with lock:
            for event in events:
                if event.kind == "seen":
                    seen.setdefault(event.pid, time.perf_counter())

    watcher.scan()
    watcher.add_listener(on_events)
    watcher.start()
    latencies = []
    try:
        for _ in range(num_spawns):
            time.sleep(0.3)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
            started_s = time.perf_counter()
            deadline_s = started_s + 5.0
            while time.perf_counter() < deadline_s:
                with lock:
                    if child.pid in seen:
                        latencies.append(1000.0 * max(0.0, seen[child.pid] - started_s))
                        break
                time.sleep(0.002)
            child.kill()
            child.wait()
    finally:
        watcher.stop()
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--spawns", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    percent, num_processes, num_ticks = cpu_cost(args.seconds)
    latencies = detection_ms(args.spawns)
    figures = [
        figure("watcher CPU, % of one core", percent, "%", 1.0, 1.0, higher_is_better=False,
               notes=f"{num_processes} processes, {num_ticks} ticks of {INTERVAL_S * 1000:.0f} ms"),
        figure("new process seen, median", statistics.median(latencies), "ms", 250.0, 1.0,
               higher_is_better=False),
        figure("new process seen, max", max(latencies), "ms", 250.0, 1.0,
               higher_is_better=False),
    ]
    print(format_figures(figures, "target"))
    write_json({"figures": figures, "latencies_ms": latencies,
                "num_processes": num_processes}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
