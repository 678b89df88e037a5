"""The CPU twin of the CUDA VMM backend: anonymous mmap, release by madvise(MADV_DONTNEED).

The address stays valid after a release and reads give zeros, which is what lets tests and
CPU-only machines run the whole release/refill lifecycle without a GPU. `max_resident_bytes`
is a real budget shared by every arena on this backend: it models another process holding
device memory, so a refill can fail the way it does on a busy GPU.
"""

from __future__ import annotations

import errno
import logging
import mmap
import warnings
from typing import Any

import torch

from strata.engine.core.memory.backend import BackendOutOfMemory, Reservation
from strata.units import MIB

log = logging.getLogger(__name__)

# Linux >= 5.14; Python 3.11's mmap module does not name it yet.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class CpuMmapBackend:
    """Arena backend over anonymous private mmap; granularity mirrors CUDA's 2 MiB by default."""

    kind = "cpu"

    def __init__(self, granularity_bytes: int = 2 * MIB, max_resident_bytes: int | None = None):
        if granularity_bytes <= 0 or granularity_bytes % mmap.PAGESIZE:
            raise ValueError(
                f"granularity_bytes {granularity_bytes} must be a positive multiple of the "
                f"page size {mmap.PAGESIZE}"
            )
        self.device = torch.device("cpu")
        self.granularity_bytes = granularity_bytes
        self.max_resident_bytes = max_resident_bytes
        self.resident_bytes = 0
        self._can_populate = True

    def reserve(self, size_bytes: int) -> Reservation:
        """Map an anonymous range with no pages behind it yet (Linux allocates on touch)."""
        mm = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers only
            base = torch.frombuffer(mm, dtype=torch.uint8)
        return Reservation(base.data_ptr(), size_bytes, base, handle=mm)

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
        if self._can_populate:
            try:
                reservation.handle.madvise(_MADV_POPULATE_WRITE, offset_bytes, size_bytes)
            except OSError as exc:
                if exc.errno == errno.ENOMEM:
                    # Give back whatever got populated before the OS ran out.
                    reservation.handle.madvise(mmap.MADV_DONTNEED, offset_bytes, size_bytes)
                    raise BackendOutOfMemory(size_bytes, "the OS has no free RAM for it") from exc
                # Older kernels (EINVAL): pages fault in on first write instead.
                log.debug("MADV_POPULATE_WRITE unavailable (%s); pages fault in on touch", exc)
                self._can_populate = False
        self.resident_bytes += size_bytes
        return size_bytes

    def set_access(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> None:
        """Anonymous mmap is readable and writable from the start."""

    def unmap_chunk(
        self, reservation: Reservation, offset_bytes: int, size_bytes: int, handle: Any
    ) -> None:
        """Return the chunk's pages to the OS; the address stays and later reads give zeros."""
        reservation.handle.madvise(mmap.MADV_DONTNEED, offset_bytes, size_bytes)
        self.resident_bytes -= size_bytes

    def synchronize(self) -> None:
        """CPU work is synchronous; nothing can be in flight."""

    def free(self, reservation: Reservation) -> None:
        """Close the mapping, or leave it to the garbage collector while tensors still view it."""
        try:
            reservation.handle.close()
        except BufferError:
            # Live tensor views export the buffer; the mapping goes when the last one does.
            log.debug(
                "mmap of %d bytes still viewed by tensors; freed by GC", reservation.size_bytes
            )
