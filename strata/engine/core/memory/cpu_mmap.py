"""The CPU twin of the CUDA VMM backend: OS pages (os_pages.py), released chunk by chunk.

On Linux the range is anonymous mmap and a release is madvise(MADV_DONTNEED); on Windows it is
VirtualAlloc and a release is VirtualFree(MEM_DECOMMIT). Either way the address stays reserved
and a refilled chunk reads zeros before its copy, which is what lets tests and CPU-only machines
run the whole release/refill lifecycle without a GPU. `max_resident_bytes`
is a real budget shared by every arena on this backend: it models another process holding
device memory, so a refill can fail the way it does on a busy GPU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from strata.engine.core.memory import os_pages
from strata.engine.core.memory.reservation import BackendOutOfMemory, Reservation
from strata.units import MIB

log = logging.getLogger(__name__)


class CpuMmapBackend:
    """Arena backend over OS pages; granularity mirrors CUDA's 2 MiB by default."""

    kind = "cpu"

    def __init__(self, granularity_bytes: int = 2 * MIB, max_resident_bytes: int | None = None):
        if granularity_bytes <= 0 or granularity_bytes % os_pages.PAGE_SIZE_BYTES:
            raise ValueError(
                f"granularity_bytes {granularity_bytes} must be a positive multiple of the "
                f"page size {os_pages.PAGE_SIZE_BYTES}"
            )
        self.device = torch.device("cpu")
        self.granularity_bytes = granularity_bytes
        self.max_resident_bytes = max_resident_bytes
        self.resident_bytes = 0

    def reserve(self, size_bytes: int) -> Reservation:
        """Reserve a range of OS pages with none committed yet."""
        pages = os_pages.reserve(size_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers only
            base = torch.frombuffer(pages.buffer, dtype=torch.uint8)
        return Reservation(base.data_ptr(), size_bytes, base, handle=pages)

    def map_chunk(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> Any:
        """Charge the chunk against the budget and fault its pages in, like cuMemCreate would."""
        if self.max_resident_bytes is not None:
            free_bytes = self.max_resident_bytes - self.resident_bytes
            if size_bytes > free_bytes:
                raise BackendOutOfMemory(
                    size_bytes,
                    f"only {max(free_bytes, 0) / MIB:.0f} MiB of the "
                    f"{self.max_resident_bytes / MIB:.0f} MiB budget is free",
                )
        try:
            reservation.handle.commit(offset_bytes, size_bytes)
        except os_pages.PagesOutOfMemory as exc:
            raise BackendOutOfMemory(size_bytes, str(exc)) from exc
        self.resident_bytes += size_bytes
        return size_bytes

    def set_access(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> None:
        """Committed pages are readable and writable from the start."""

    def unmap_chunk(
        self, reservation: Reservation, offset_bytes: int, size_bytes: int, handle: Any
    ) -> None:
        """Return the chunk's pages to the OS; the address stays, a refill reads zeros."""
        reservation.handle.decommit(offset_bytes, size_bytes)
        self.resident_bytes -= size_bytes

    def synchronize(self) -> None:
        """CPU work is synchronous; nothing can be in flight."""

    def free(self, reservation: Reservation) -> None:
        """Give the range back, or leave it to the garbage collector while tensors view it."""
        reservation.handle.close()
