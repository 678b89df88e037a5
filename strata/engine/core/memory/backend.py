"""What an arena needs from the memory underneath it: reserve, map/unmap chunks, view as torch.

Two implementations: `CudaVmmBackend` (cuda_vmm.py, CUDA virtual memory management) and
`CpuMmapBackend` (cpu_mmap.py, OS pages from os_pages.py: mmap + madvise, or VirtualAlloc on
Windows). `backend_for(device)` picks one.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

# Defined apart (reservation.py) for the implementations; importers of backend get them here.
from strata.engine.core.memory.reservation import BackendOutOfMemory, Reservation
from strata.units import MIB

__all__ = ["MIB", "ArenaBackend", "BackendOutOfMemory", "Reservation", "backend_for",
           "cuda_available", "round_up"]

log = logging.getLogger(__name__)



class ArenaBackend(Protocol):
    """The memory operations an Arena is built from; every method raises on failure."""

    kind: str  # "cuda" or "cpu"
    device: torch.device
    granularity_bytes: int

    def reserve(self, size_bytes: int) -> Reservation:
        """Reserve an address range of size_bytes (a granularity multiple); nothing mapped."""

    def map_chunk(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> Any:
        """Back [offset, offset+size) with physical memory; returns a handle for unmap_chunk.

        Raises BackendOutOfMemory when the memory is not there."""

    def set_access(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> None:
        """Make a freshly mapped range (possibly several chunks) readable and writable."""

    def unmap_chunk(
        self, reservation: Reservation, offset_bytes: int, size_bytes: int, handle: Any
    ) -> None:
        """Unmap a chunk mapped by map_chunk and give its physical memory back."""

    def synchronize(self) -> None:
        """Wait until no queued work can still touch device memory."""

    def free(self, reservation: Reservation) -> None:
        """Give the address range back; every chunk must be unmapped first."""


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


def cuda_available() -> bool:
    """True when a CUDA driver and a device are usable; never raises (no driver, no GPU)."""
    try:
        from strata.engine.core.memory.cuda_vmm import driver_device_count

        return torch.cuda.is_available() and driver_device_count() > 0
    except Exception as exc:  # noqa: BLE001 - cuInit raises, not returns, when libcuda is absent
        log.debug("CUDA not available: %s", exc)
        return False


def backend_for(device: str | torch.device = "auto") -> ArenaBackend:
    """The arena backend for a device: "cuda[:N]", "cpu", or "auto" (CUDA when present)."""
    name = str(device)
    if name == "auto":
        name = "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        from strata.engine.core.memory.cpu_mmap import CpuMmapBackend

        return CpuMmapBackend()
    if name.startswith("cuda"):
        if not cuda_available():
            raise RuntimeError(
                f"device {name!r} asked for, but no CUDA driver or GPU is usable here; "
                "install the NVIDIA driver or run with device 'cpu'"
            )
        from strata.engine.core.memory.cuda_vmm import CudaVmmBackend

        index = torch.device(name).index
        return CudaVmmBackend(device_index=0 if index is None else index)
    raise ValueError(f"unknown device {name!r}: use 'auto', 'cpu' or 'cuda[:N]'")
