"""bench/run_group.sh: a time limit that ends the command and every process it started
(a cut GPU test run's xdist workers kept using the GPU under the next benchmark, run 31c)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "run_group.sh"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run(limit_s: int, shell: str) -> tuple[int, float]:
    started = time.monotonic()
    done = subprocess.run([str(SCRIPT), str(limit_s), "bash", "-c", shell], timeout=60)
    return done.returncode, time.monotonic() - started


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_the_limit_ends_the_command_and_the_workers_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    rc, took_s = _run(1, f"sleep 300 & echo $! > {pids}; sleep 300")
    worker = int(pids.read_text())
    assert rc == 124 and took_s < 30
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_a_command_that_ends_keeps_its_status_and_leaves_no_worker(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    rc, took_s = _run(60, f"sleep 300 & echo $! > {pids}; exit 3")
    assert rc == 3 and took_s < 30
    worker = int(pids.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)
    assert _run(60, "true")[0] == 0


def test_a_call_without_a_command_is_refused() -> None:
    done = subprocess.run([str(SCRIPT), "5"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.skipif(os.name != "posix", reason="a bash script")
def test_a_caller_reading_the_output_gets_it_when_the_command_ends() -> None:
    # The watchdog's sleep once outlived the script and held the pipe until the limit.
    done = subprocess.run([str(SCRIPT), "120", "echo", "hi"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0 and done.stdout == "hi\n"
