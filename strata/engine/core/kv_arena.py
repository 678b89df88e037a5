"""The kv arena: every cache slot's K/V at a fixed address range, pages mapped as tokens grow.

Address space is free, so each slot gets a range for the full context: per layer a K and a V
region of max_tokens rows, each aligned to the arena's chunk size. Physical pages are mapped
per region as the slot's tokens grow (zeroed when new: attention may read masked rows, and a
stale NaN times a zero weight is still NaN), and a released slot gives its pages back while
its range stays reserved, so a restored slot lands at the same addresses and CUDA graphs
captured over it stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.backend import ArenaBackend, round_up
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.slots import SlotManager
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

    def load_rows(self, state: list[torch.Tensor], num_tokens: int) -> None:
        """Map and fill region by region (KVArena.fill), so mapping overlaps the copies."""
        self.kv_arena.fill(self.slot, state, num_tokens)


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

    def _bytes_for(self, num_tokens: int) -> int:
        """Bytes of each region that rows 0..num_tokens-1 need mapped (whole chunks)."""
        return min(round_up(num_tokens * self.row_bytes, self.chunk_bytes), self.region_stride_bytes)

    def _map_regions(
        self, slot: int, want_bytes: int, regions: Iterable[int],
        after_map: Callable[[int, int], None],
    ) -> None:
        """Map bytes [mapped, want_bytes) of each region, in `regions` order, calling
        after_map(region, region_offset) as soon as its pages are there, so that work (a zero,
        a copy) runs while the next region's driver calls do. All regions grow or none does:
        on failure what this call mapped goes back (release_range synchronizes first, so work
        queued on those pages has finished) and the error propagates."""
        have_bytes = self._mapped_bytes[slot]
        done: list[int] = []
        try:
            for region in regions:
                offset = self._region_offset(slot, region)
                self.arena.map_range(offset + have_bytes, want_bytes - have_bytes)
                done.append(offset)
                after_map(region, offset)
        except BaseException:
            for offset in done:
                self.arena.release_range(offset + have_bytes, want_bytes - have_bytes)
            raise
        self._mapped_bytes[slot] = want_bytes

    def ensure_tokens(self, slot: int, num_tokens: int) -> int:
        """Map and zero the pages rows 0..num_tokens-1 need in every region; returns new bytes.

        Raises ArenaMapError (nothing of this call stays mapped) when memory is short."""
        if num_tokens <= self.mapped_tokens(slot):
            return 0
        want_bytes = self._bytes_for(num_tokens)
        have_bytes = self._mapped_bytes[slot]

        def zero_new(region: int, offset: int) -> None:
            self.arena.tensor(offset + have_bytes, (want_bytes - have_bytes,), torch.uint8).zero_()

        self._map_regions(slot, want_bytes, range(self.num_regions), zero_new)
        return self.num_regions * (want_bytes - have_bytes)

    def fill(self, slot: int, state: list[torch.Tensor], num_tokens: int) -> None:
        """Map the pages of an empty slot region by region, copying each region's rows in
        right after its pages are mapped: the driver calls for region r+1 then run while region
        r's copy is on the bus (for a 32k-token Qwen3-30B-A3B KV on an H200: 9 ms of mapping and
        18 ms of copying, 27 ms in sequence). Only the rows past num_tokens in the last chunk
        are zeroed; the copy overwrites the rest.

        state: region order, [num_tokens, kv_heads, head_dim] each; pinned host memory makes the
        copies asynchronous, and the caller synchronizes before freeing it. Raises
        ArenaMapError with nothing of this call mapped when memory is short.
        """
        if self._mapped_bytes[slot]:
            raise ValueError(f"kv arena: slot {slot} must be empty to be filled")
        if len(state) != self.num_regions:
            raise ValueError(f"kv arena: {len(state)} regions to fill, not {self.num_regions}")
        want_bytes = self._bytes_for(num_tokens)
        used_bytes = num_tokens * self.row_bytes
        views = self.region_views(slot)
        sources = {self.arena_region(index): src for index, src in enumerate(state)}

        def copy_in(region: int, offset: int) -> None:
            if want_bytes > used_bytes:
                self.arena.tensor(offset + used_bytes, (want_bytes - used_bytes,),
                                  torch.uint8).zero_()
            views[region][:num_tokens].copy_(sources[region], non_blocking=True)

        self._map_regions(slot, want_bytes, sources, copy_in)  # in snapshot order

    def arena_region(self, index: int) -> int:
        """The arena region of snapshot region `index` (k0, v0, k1, v1, ...): the arena lays
        out every layer's K first, then every V."""
        layer, is_v = divmod(index, 2)
        return is_v * self.config.num_hidden_layers + layer

    def release_region(self, slot: int, index: int) -> int:
        """Give snapshot region `index`'s pages back without a device sync: for a caller that
        knows nothing queued reads them (an offload, once that region's copy to the host
        completed). The slot is unusable until release_slot; returns bytes freed."""
        return self.arena.release_range(self._region_offset(slot, self.arena_region(index)),
                                        self.region_stride_bytes, synchronize=False)

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
        # A restore maps exactly the rows its snapshot holds (ArenaKVCache.load_rows), and an
        # offload gives each region back as soon as its copy has landed (release_region).
        super().__init__(num_slots, kv_budget_bytes, self._make_kv, store, self._release_kv,
                         release_region=kv_arena.release_region)
        self.kv_arena = kv_arena

    def _make_kv(self, slot: int) -> ArenaKVCache:
        return self.kv_arena.make_kv(slot)

    def _release_kv(self, slot: int, kv: KVCache) -> None:
        self.kv_arena.release_slot(slot)
