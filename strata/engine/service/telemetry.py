"""GPU and RAM readings for the dashboard and the rules: NVML through pynvml, RAM through psutil.

Qt-free and never raises for a missing GPU: `GpuTelemetry.read()` answers None (and
`unavailable_reason` says why) on a machine without an NVIDIA driver, so callers show RAM instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import psutil

from strata.engine.core.memory.vram import (
    GpuProcess,
    gpu_name,
    gpu_processes,
    nvml_unavailable_reason,
    read_vram_info,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSnapshot:
    """Memory of one GPU at one moment."""

    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    processes: tuple[GpuProcess, ...] = ()

    def used_by_others_bytes(self, own_pids: set[int]) -> int:
        """Bytes that processes outside own_pids hold, by NVML's per-process accounting."""
        return sum(p.used_bytes or 0 for p in self.processes if p.pid not in own_pids)


@dataclass(frozen=True)
class RamSnapshot:
    """Host memory at one moment; strata_bytes is the RSS of the given processes."""

    total_bytes: int
    available_bytes: int
    strata_bytes: int

    @property
    def used_by_others_bytes(self) -> int:
        return max(0, self.total_bytes - self.available_bytes - self.strata_bytes)


def read_ram(pids: set[int] | None = None) -> RamSnapshot:
    """Host RAM now, with the resident bytes of pids (default: this process) as Strata's share."""
    memory = psutil.virtual_memory()
    strata_bytes = 0
    for pid in pids or {os.getpid()}:
        try:
            strata_bytes += psutil.Process(pid).memory_info().rss
        except (psutil.Error, OSError):
            continue  # the engine process may have just exited
    return RamSnapshot(memory.total, memory.available, strata_bytes)


class GpuTelemetry:
    """Reads one NVIDIA GPU for the dashboard and the rules, through the NVML helpers the VRAM
    guard uses (strata/engine/core/memory/vram.py); None and a reason without an NVIDIA GPU."""

    def __init__(self, device_index: int = 0):
        self.device_index = device_index
        self.unavailable_reason: str | None = None

    def read(self) -> GpuSnapshot | None:
        """The GPU's memory and processes now, or None without an NVIDIA GPU."""
        info = read_vram_info(self.device_index)
        if info is None:
            reason = nvml_unavailable_reason() or "NVML could not read the GPU's memory"
            self.unavailable_reason = f"no NVIDIA GPU found ({reason})"
            return None
        self.unavailable_reason = None
        return GpuSnapshot(
            gpu_name(self.device_index), info.total_bytes, info.free_bytes, info.used_bytes,
            tuple(gpu_processes(self.device_index)),
        )
