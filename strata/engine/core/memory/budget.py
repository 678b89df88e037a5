"""A cap on what one engine maps in total (--vram-budget): a 12 or 24 GiB card on a large GPU.

`BudgetedBackend` wraps any arena backend and refuses a chunk that would take the memory
mapped across all its arenas (weights, experts, KV) past the budget, with the same
BackendOutOfMemory a full GPU gives: release, refill, the VRAM guard and the expert cache's
sizing all behave as they would on the smaller card.
"""

from __future__ import annotations

from typing import Any

from strata.engine.core.memory.backend import ArenaBackend, BackendOutOfMemory, Reservation
from strata.units import MIB


class BudgetedBackend:
    """An ArenaBackend that maps at most budget_bytes at once; everything else is the inner
    backend's."""

    def __init__(self, inner: ArenaBackend, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"a VRAM budget must be positive, not {budget_bytes} bytes")
        self.inner = inner
        self.budget_bytes = budget_bytes
        self.mapped_bytes = 0
        self.kind = inner.kind
        self.device = inner.device
        self.granularity_bytes = inner.granularity_bytes

    @property
    def free_bytes(self) -> int:
        """What the budget still allows to map."""
        return self.budget_bytes - self.mapped_bytes

    def reserve(self, size_bytes: int) -> Reservation:
        return self.inner.reserve(size_bytes)  # address space costs no memory

    def map_chunk(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> Any:
        if size_bytes > self.free_bytes:
            raise BackendOutOfMemory(
                size_bytes, f"the VRAM budget of {self.budget_bytes / MIB:.0f} MiB has "
                f"{self.free_bytes / MIB:.0f} MiB left (--vram-budget)")
        handle = self.inner.map_chunk(reservation, offset_bytes, size_bytes)
        self.mapped_bytes += size_bytes
        return handle

    def set_access(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> None:
        self.inner.set_access(reservation, offset_bytes, size_bytes)

    def unmap_chunk(self, reservation: Reservation, offset_bytes: int, size_bytes: int,
                    handle: Any) -> None:
        self.inner.unmap_chunk(reservation, offset_bytes, size_bytes, handle)
        self.mapped_bytes -= size_bytes

    def synchronize(self) -> None:
        self.inner.synchronize()

    def free(self, reservation: Reservation) -> None:
        self.inner.free(reservation)


def budget_free_bytes(backend: Any) -> int | None:
    """What a BudgetedBackend still allows to map; None for a backend without a budget."""
    return backend.free_bytes if isinstance(backend, BudgetedBackend) else None
