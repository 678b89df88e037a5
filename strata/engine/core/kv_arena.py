"""The kv arena: every cache slot's K/V at a fixed address range, pages mapped as tokens grow.

Address space is free, so each slot gets a range for the full context: per layer a K and a V
region of max_tokens rows, each aligned to the arena's chunk size. Physical pages are mapped
per region as the slot's tokens grow (zeroed when new: attention may read masked rows, and a
stale NaN times a zero weight is still NaN), and a released slot gives its pages back while
its range stays reserved, so a restored slot lands at the same addresses and CUDA graphs
captured over it stay valid.
"""

from __future__ import annotations

import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.backend import ArenaBackend, round_up
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.slots import SlotManager
from strata.engine.core.snapshots.kv_state import KVSnapshot, SlotCache
from strata.engine.core.snapshots.store import SnapshotStore
from strata.units import MIB

MAX_KV_CHUNK_BYTES = 64 * MIB
CHUNKS_PER_REGION = 8  # pages come in about an eighth of a region at a time


class ArenaKVCache(KVCache):
    """A KVCache whose buffers are views of one slot's range in the kv arena."""

    def __init__(self, kv_arena: KVArena, slot: int):
        self.kv_arena = kv_arena
        self.slot = slot
        config = kv_arena.config
        views = iter(kv_arena.region_views(slot))
        super().__init__(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
            kv_arena.max_tokens, kv_arena.dtype, kv_arena.arena.device,
            allocate=lambda shape, dtype: next(views),
        )

    def ensure_tokens(self, num_tokens: int) -> None:
        """Map (and zero) pages so rows 0..num_tokens-1 of every layer are usable."""
        self.kv_arena.ensure_tokens(self.slot, num_tokens)


class KVArena:
    """One arena holding num_slots ranges of K/V for max_tokens tokens each."""

    def __init__(
        self,
        config: ModelConfig,
        max_tokens: int,
        dtype: torch.dtype,
        backend: ArenaBackend,
        num_slots: int,
        name: str = "kv",
    ):
        self.config = config
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.num_slots = num_slots
        self.num_regions = 2 * config.num_hidden_layers  # k0..k(L-1), then v0..v(L-1)
        self.row_bytes = config.num_key_value_heads * config.head_dim * dtype.itemsize
        region_bytes = max_tokens * self.row_bytes
        granularity = backend.granularity_bytes
        self.chunk_bytes = min(
            max(round_up(-(-region_bytes // CHUNKS_PER_REGION), granularity), granularity),
            max(MAX_KV_CHUNK_BYTES, granularity),
        )
        self.region_stride_bytes = round_up(region_bytes, self.chunk_bytes)
        self.slot_stride_bytes = self.num_regions * self.region_stride_bytes
        self.arena = Arena(name, num_slots * self.slot_stride_bytes, backend, self.chunk_bytes)
        self._mapped_bytes = [0] * num_slots  # per region of the slot: bytes mapped from its start

    def _region_offset(self, slot: int, region: int) -> int:
        return slot * self.slot_stride_bytes + region * self.region_stride_bytes

    def region_views(self, slot: int) -> list[torch.Tensor]:
        """[max_tokens, kv_heads, head_dim] views of the slot's regions (mapped or not)."""
        shape = (self.max_tokens, self.config.num_key_value_heads, self.config.head_dim)
        return [
            self.arena.tensor(self._region_offset(slot, r), shape, self.dtype, require_mapped=False)
            for r in range(self.num_regions)
        ]

    def mapped_tokens(self, slot: int) -> int:
        """How many token rows of the slot are backed by memory now."""
        return min(self._mapped_bytes[slot] // self.row_bytes, self.max_tokens)

    def ensure_tokens(self, slot: int, num_tokens: int) -> int:
        """Map and zero the pages rows 0..num_tokens-1 need in every region; returns new bytes.

        Raises ArenaMapError (nothing of this call stays mapped) when memory is short."""
        if num_tokens <= self.mapped_tokens(slot):
            return 0
        want_bytes = min(round_up(num_tokens * self.row_bytes, self.chunk_bytes),
                         self.region_stride_bytes)
        have_bytes = self._mapped_bytes[slot]
        done: list[int] = []
        try:
            for region in range(self.num_regions):
                self.arena.map_range(self._region_offset(slot, region) + have_bytes,
                                     want_bytes - have_bytes)
                done.append(region)
        except BaseException:
            for region in done:  # all regions grow together, or none does
                self.arena.release_range(self._region_offset(slot, region) + have_bytes,
                                         want_bytes - have_bytes)
            raise
        for region in range(self.num_regions):
            offset = self._region_offset(slot, region) + have_bytes
            self.arena.tensor(offset, (want_bytes - have_bytes,), torch.uint8).zero_()
        self._mapped_bytes[slot] = want_bytes
        return self.num_regions * (want_bytes - have_bytes)

    def make_kv(self, slot: int, num_tokens: int = 0) -> ArenaKVCache:
        """A fresh (zeroed) cache over the slot's range, with pages for num_tokens mapped."""
        self.release_slot(slot)
        kv = ArenaKVCache(self, slot)
        self.ensure_tokens(slot, num_tokens)
        return kv

    def release_slot(self, slot: int) -> int:
        """Give the slot's pages back; its range (and views over it) stay. Returns bytes freed."""
        self._mapped_bytes[slot] = 0
        return self.arena.release_range(slot * self.slot_stride_bytes, self.slot_stride_bytes)

    def release_all(self) -> int:
        """Every slot's pages back (sleep, unload); returns bytes freed."""
        return sum(self.release_slot(slot) for slot in range(self.num_slots))

    def close(self) -> None:
        self._mapped_bytes = [0] * self.num_slots
        self.arena.close()


class ArenaSlotManager(SlotManager):
    """A SlotManager whose slots live in a KVArena: a restored slot maps just the pages its
    snapshot needs, and an evicted or offloaded slot's pages really go back."""

    def __init__(
        self, num_slots: int, kv_budget_bytes: int, kv_arena: KVArena, store: SnapshotStore
    ):
        super().__init__(num_slots, kv_budget_bytes, self._make_kv, store, self._release_kv)
        self.kv_arena = kv_arena
        self._tokens_to_restore = 0

    def _install(self, slot: int, snapshot: KVSnapshot | None) -> SlotCache:
        # The snapshot is known only here; make_kv maps exactly the rows it will write.
        self._tokens_to_restore = snapshot.num_tokens if snapshot is not None else 0
        try:
            return super()._install(slot, snapshot)
        finally:
            self._tokens_to_restore = 0

    def _make_kv(self, slot: int) -> ArenaKVCache:
        num_tokens = min(self._tokens_to_restore, self.kv_arena.max_tokens)
        return self.kv_arena.make_kv(slot, num_tokens)

    def _release_kv(self, slot: int, kv: KVCache) -> None:
        self.kv_arena.release_slot(slot)
