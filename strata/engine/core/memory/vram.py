"""What NVML says about the GPU: free VRAM and which processes hold it.

NVML never creates a CUDA context, so the host process (VRAM guard, tray dashboard) can call
this without touching the GPU. Every function answers None / [] when NVML is absent.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_nvml: Any = None
_nvml_failed_reason: str | None = None


@dataclass(frozen=True)
class VramInfo:
    total_bytes: int
    free_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None  # None where the driver does not tell (e.g. no permission)


def _load_nvml() -> Any:
    """pynvml, initialized once; None (and the reason logged once) when NVML is unusable."""
    global _nvml, _nvml_failed_reason
    if _nvml is not None or _nvml_failed_reason is not None:
        return _nvml
    try:
        import pynvml

        pynvml.nvmlInit()
        _nvml = pynvml
    except Exception as exc:  # noqa: BLE001 - no package/library/driver
        _nvml_failed_reason = str(exc) or type(exc).__name__
        log.info("NVML unavailable (%s): VRAM figures are not reported", _nvml_failed_reason)
    return _nvml


def _device_handle(nvml: Any, device_index: int) -> Any:
    """NVML handle of CUDA device `device_index`, honouring CUDA_VISIBLE_DEVICES.

    NVML numbers all GPUs while CUDA numbers the visible ones, so translate through the
    variable: integer entries are NVML indices, GPU-/MIG- entries are UUIDs.
    """
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    if device_index < len(visible):
        entry = visible[device_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(device_index)


def read_vram_info(device_index: int = 0) -> VramInfo | None:
    """Total, free and used VRAM of one GPU as NVML reports it; None without NVML."""
    nvml = _load_nvml()
    if nvml is None:
        return None
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(_device_handle(nvml, device_index))
    except nvml.NVMLError as exc:
        log.warning("NVML could not read memory of GPU %d: %s", device_index, exc)
        return None
    return VramInfo(int(info.total), int(info.free), int(info.used))


def nvml_unavailable_reason() -> str | None:
    """Why NVML cannot be used here (no driver, no library), or None when it works."""
    _load_nvml()
    return _nvml_failed_reason


def gpu_name(device_index: int = 0) -> str:
    """The GPU's marketing name ("NVIDIA H200"); "" without NVML."""
    nvml = _load_nvml()
    if nvml is None:
        return ""
    try:
        name = nvml.nvmlDeviceGetName(_device_handle(nvml, device_index))
    except nvml.NVMLError:
        return ""
    return name.decode(errors="replace") if isinstance(name, bytes) else name


def read_free_vram_bytes(device_index: int = 0) -> int | None:
    """Free VRAM in bytes, or None when NVML is absent (the guard then cannot wait on it)."""
    info = read_vram_info(device_index)
    return None if info is None else info.free_bytes


def _process_name(nvml: Any, pid: int) -> str:
    import psutil

    try:
        return psutil.Process(pid).name()
    except psutil.Error as exc:  # another user's process, or one in another PID namespace
        log.debug("psutil cannot name pid %d (%s); asking NVML", pid, exc)
    try:
        name = nvml.nvmlSystemGetProcessName(pid)
    except nvml.NVMLError:
        return f"pid {pid}"
    name = name.decode() if isinstance(name, bytes) else name
    return os.path.basename(name) or f"pid {pid}"


def gpu_processes(device_index: int = 0) -> list[GpuProcess]:
    """Processes holding memory on the GPU (compute and graphics), largest first; [] w/o NVML."""
    nvml = _load_nvml()
    entries = _running_processes(nvml, device_index, logging.WARNING)
    used_by_pid: dict[int, int | None] = {}
    for entry in entries:
        used = getattr(entry, "usedGpuMemory", None)
        used = int(used) if isinstance(used, int) else None
        # A process using both compute and graphics is listed twice with the same memory.
        known = [u for u in (used_by_pid.get(entry.pid), used) if u is not None]
        used_by_pid[entry.pid] = max(known) if known else None
    processes = [
        GpuProcess(pid, _process_name(nvml, pid), used) for pid, used in used_by_pid.items()
    ]
    return sorted(processes, key=lambda p: -(p.used_bytes or 0))


def gpu_pids(device_index: int = 0) -> list[int]:
    """Pids of the processes using the GPU (compute and graphics), without naming them: cheap
    enough for the rules' gpu_process watcher to call ten times a second; [] without NVML."""
    entries = _running_processes(_load_nvml(), device_index, logging.DEBUG)
    return sorted({int(entry.pid) for entry in entries})


def _running_processes(nvml, device_index: int, failure_level: int) -> list:
    """NVML's compute and graphics process entries of the GPU; [] without NVML or on error
    (logged at failure_level: the ten-times-a-second watcher stays quiet)."""
    if nvml is None:
        return []
    try:
        handle = _device_handle(nvml, device_index)
        entries = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        entries += list(nvml.nvmlDeviceGetGraphicsRunningProcesses(handle))
    except nvml.NVMLError as exc:
        log.log(failure_level, "NVML could not list processes of GPU %d: %s", device_index, exc)
        return []
    return entries
