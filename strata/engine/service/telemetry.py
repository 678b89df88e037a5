"""GPU and RAM readings for the dashboard and the rules: NVML through pynvml, RAM through psutil.

Qt-free and never raises for a missing GPU: `GpuTelemetry.read()` answers None (and
`unavailable_reason` says why) on a machine without an NVIDIA driver, so callers show RAM instead.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuProcess:
    """One process holding memory on the GPU (compute or graphics context)."""

    pid: int
    name: str
    used_bytes: int  # 0 where the driver cannot tell (Windows WDDM reports no per-process use)


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
        return sum(p.used_bytes for p in self.processes if p.pid not in own_pids)


@dataclass(frozen=True)
class RamSnapshot:
    """Host memory at one moment; strata_bytes is the RSS of the given processes."""

    total_bytes: int
    available_bytes: int
    strata_bytes: int

    @property
    def used_by_others_bytes(self) -> int:
        return max(0, self.total_bytes - self.available_bytes - self.strata_bytes)


def process_name(pid: int) -> str:
    """The short name of a process, or "pid N" when it is gone or not ours to inspect."""
    try:
        return psutil.Process(pid).name()
    except (psutil.Error, OSError):
        return f"pid {pid}"


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
    """Reads one NVIDIA GPU through NVML; initialises NVML once, lazily, thread-safely."""

    def __init__(self, device_index: int = 0):
        self.device_index = device_index
        self._lock = threading.Lock()
        self._handle = None
        self._nvml = None
        self._tried = False
        self.unavailable_reason: str | None = None

    def _ensure(self) -> bool:
        if self._tried:
            return self._handle is not None
        self._tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self._nvml = pynvml
        except Exception as exc:  # no driver, no library, no such device: all mean "no GPU"
            self.unavailable_reason = f"no NVIDIA GPU found ({exc})"
            log.info("GPU telemetry off: %s", self.unavailable_reason)
            return False
        return True

    @property
    def is_available(self) -> bool:
        with self._lock:
            return self._ensure()

    def read(self) -> GpuSnapshot | None:
        """The GPU's memory and processes now, or None without an NVIDIA GPU."""
        with self._lock:
            if not self._ensure():
                return None
            nvml = self._nvml
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
                name = nvml.nvmlDeviceGetName(self._handle)
                processes = self._processes()
            except nvml.NVMLError as exc:  # e.g. the GPU fell off the bus; report, don't crash
                self.unavailable_reason = f"NVML read failed ({exc})"
                return None
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return GpuSnapshot(name, memory.total, memory.free, memory.used, processes)

    def _processes(self) -> tuple[GpuProcess, ...]:
        used_by_pid: dict[int, int] = {}
        for query in (
            self._nvml.nvmlDeviceGetComputeRunningProcesses,
            self._nvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                entries = query(self._handle)
            except self._nvml.NVMLError:
                continue  # some drivers do not support the graphics query
            for entry in entries:
                used = entry.usedGpuMemory or 0  # None under WDDM
                used_by_pid[entry.pid] = max(used_by_pid.get(entry.pid, 0), int(used))
        return tuple(
            GpuProcess(pid, process_name(pid), used)
            for pid, used in sorted(used_by_pid.items(), key=lambda item: -item[1])
        )

    def close(self) -> None:
        """Shut NVML down; a later read() initialises it again."""
        with self._lock:
            if self._handle is not None:
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass
            self._handle = None
            self._tried = False
