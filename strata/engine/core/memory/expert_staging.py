"""One layer's experts whole, for a prefill chunk over a partial expert cache.

A long prefill chunk routes to nearly every expert of a layer (4096 tokens x 8 of 128: each
expert all but surely). Reading the missing ones one by one into slots (evicting others),
then multiplying expert by expert, cost the prefill 6-12 s for 4096 tokens of Qwen3-30B-A3B
(docs/benchmarks.md, runs 33b and 34). Instead, per layer, a staging area holds the layer's
experts as the stacked [E, ...] projections the all-resident prefill reads, so the same
grouped GEMMs run (fast/moe_prefill.py):

- experts that are not resident come from the pinned host copy, in runs of consecutive
  experts (one copy per projection and run; a run bridges a gap of a few resident experts
  when their bytes are fewer than MAX_GAP_BYTES, since one larger copy costs less than two);
- resident ones are gathered from their slots on the device (an index_select, at VRAM
  speed);
- nothing enters the cache: the slots keep decode's working set (a prefill chunk would
  otherwise evict it for experts the answer never uses again), and no expert is copied twice
  for one layer of one chunk.

The copies run on the store's side stream, the compute stream waits for them. `prefetch`
stages the next layer while this one computes: its copies wait for the GEMMs queued before
(one staging area), then overlap the next layer's attention and routing.
The staging lies in the slot arena after the slots, so --vram-budget and the store's mapped
bytes count it; a release unmaps it with the slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.host_copy import side_stream
from strata.units import MIB

# A gap of resident experts between two runs of missing ones is copied from the host with
# them when it holds fewer bytes than this: one copy call per projection less. Pinned copies
# reach PCIe's rate only from ~16 MiB (expert_store.copy_rows), and a Q4_K_M Qwen3-30B-A3B
# expert's projection is ~1 MiB. An estimate, not measured: the bench reports the bytes
# and calls per prefill.
MAX_GAP_BYTES = 8 * MIB
GATHER_EXPERTS = 32  # resident experts gathered per index_select (bounds its temporary)
ALIGN_BYTES = 256


def staging_bytes(proj_bytes: Sequence[tuple[int, ...]], num_experts: int) -> int:
    """Bytes the staging takes: the largest class's projections of every expert, each
    aligned (proj_bytes: per slot class, one expert's bytes per projection)."""
    return max((sum(_aligned(num_experts * b) for b in projs) for projs in proj_bytes),
               default=0)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def copy_runs(missing: Sequence[int], resident: set[int], bytes_per_expert: int,
              max_gap_bytes: int = MAX_GAP_BYTES) -> list[tuple[int, int]]:
    """(first expert, count) runs covering the sorted missing experts: consecutive ones, and
    a gap between two runs when it holds only resident experts of fewer than max_gap_bytes."""
    runs: list[tuple[int, int]] = []
    for expert in missing:
        if runs:
            first, count = runs[-1]
            gap = range(first + count, expert)
            if len(gap) * bytes_per_expert <= max_gap_bytes and all(
                    e in resident for e in gap):
                runs[-1] = (first, expert - first + 1)
                continue
        runs.append((expert, 1))
    return runs


def wide_rows(*weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of weights [n, ...] (contiguous rows) as [n, m] of one integer type, the widest
    that divides every row's bytes and every address (one for all: index_copy_ takes its
    source in its own dtype), the same memory. index_select and index_copy_ move one element
    a thread with index math per element, in 64 bits once a tensor passes 2**31 elements: as
    uint8, a 30B MoE's slots (several GB a projection) are past that, and a gather moved a
    byte at a time (docs/benchmarks.md, run 42: the prefill that only gathered). Eight bytes
    an element cuts the elements eightfold and keeps 32-bit math."""
    rows = [w.view(w.shape[0], -1).view(torch.uint8) for w in weights]
    for wide in (torch.int64, torch.int32, torch.int16):
        size = wide.itemsize
        if all(r.stride(1) == 1 and r.shape[1] % size == 0 and r.data_ptr() % size == 0
               for r in rows):
            return tuple(r.view(wide) for r in rows)
    return tuple(rows)


def gather(staging: Sequence[torch.Tensor], slots: Sequence[torch.Tensor],
           experts: Sequence[int], slot_of: Mapping[int, int] | Sequence[int]) -> None:
    """Copy each of experts from its slot (slot_of[expert], an index of slots' rows) into
    its row of the staging, per projection (staging and slots pair up), GATHER_EXPERTS at a
    time, over wide_rows views, on the current stream."""
    if not experts:
        return
    device = staging[0].device
    pairs = [wide_rows(dst, src) for dst, src in zip(staging, slots)]
    for begin in range(0, len(experts), GATHER_EXPERTS):
        part = experts[begin: begin + GATHER_EXPERTS]
        dst_index = torch.tensor(part, dtype=torch.long).to(device, non_blocking=True)
        src_index = torch.tensor([slot_of[e] for e in part], dtype=torch.long).to(
            device, non_blocking=True)
        for dst, src in pairs:
            dst.index_copy_(0, dst_index, src.index_select(0, src_index))


class ExpertStaging:
    """The staging area of an ExpertStore, and which layer's experts it holds."""

    def __init__(self, store: Any, flat: torch.Tensor, num_layers: int):
        self.store = store  # its ExpertStore (not imported: that module imports this one)
        self.flat = flat  # uint8 (blocks) or the experts' dtype, staging_bytes long
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # slot class -> projections
        self.layer: int | None = None  # the layer whose experts `experts` hold valid bytes
        self.experts: set[int] = set()
        self._ready: torch.cuda.Event | None = None  # the staging's last copies done
        # Per layer: experts and bytes copied from the host copy, and bytes gathered from
        # slots; copy calls (one per run and projection).
        self.staged_experts = [0] * num_layers
        self.staged_bytes = [0] * num_layers
        self.gathered_bytes = [0] * num_layers
        self.num_copy_calls = 0

    @classmethod
    def in_own_arena(cls, store: Any, name: str, nbytes: int, num_layers: int
                     ) -> tuple[Arena, ExpertStaging, int]:
        """(arena, staging, bytes mapped): nbytes of staging for `store` in an arena of its
        own on the store's backend (ExpertStore.add_staging). Raises ArenaMapError, with the
        arena closed, when the memory is not there."""
        arena = Arena(name, nbytes + 256, store.arena.backend, store.arena.chunk_bytes)
        try:
            mapped = arena.map()
        except BaseException:
            arena.close()
            raise
        flat = arena.allocate((nbytes // store.dtype.itemsize,), store.dtype)
        return arena, cls(store, flat, num_layers), mapped

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def views(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The staging as layer's stacked projections, [E, ...] each (class-shaped)."""
        pool = self.store.cache.pool_of(layer)
        if pool not in self._views:
            klass, views, offset = self.store.classes[pool], [], 0
            itemsize = self.flat.element_size()
            for shape, nbytes in zip(klass.shapes, klass.proj_bytes):
                size = self.store.num_experts * nbytes
                part = self.flat[offset // itemsize: (offset + size) // itemsize]
                views.append(part.view(self.store.num_experts, *shape))
                offset += _aligned(size)
            self._views[pool] = tuple(views)
        return self._views[pool]

    def forget(self) -> None:
        """The staging's bytes are gone (its arena released): stage afresh."""
        self.layer, self.experts, self._ready = None, set(), None

    def stage(self, layer: int, experts: Sequence[int] | None = None,
              wait: bool = True) -> tuple[torch.Tensor, ...]:
        """layer's experts (None: every one) in the staging, [E, ...] per projection; the
        others' rows hold stale bytes. wait=False (a prefetch) leaves the compute stream free
        of the copies; the call that uses them waits."""
        store = self.store
        wanted = range(store.num_experts) if experts is None else experts
        if layer != self.layer:
            self.layer, self.experts = layer, set()
        needed = sorted(set(wanted) - self.experts)
        if needed:
            self._fill(layer, needed)
        if wait and self._ready is not None:
            torch.cuda.current_stream(store.device).wait_event(self._ready)
        return self.views(layer)

    def _fill(self, layer: int, needed: list[int]) -> None:
        """Copy the needed experts in: resident ones from their slots, the rest (and gaps
        that make fewer, larger copies) from the host copy."""
        store = self.store
        store.check_mapped()
        row = store.table_mirror[layer].tolist()  # what the published table says is in slots
        resident = {e: store.local_slot(layer, s) for e, s in enumerate(row) if s >= 0}
        runs = copy_runs([e for e in needed if e not in resident], set(resident),
                         store.bytes_of(layer), MAX_GAP_BYTES)
        from_host = {e for first, count in runs for e in range(first, first + count)}
        gathered = [e for e in needed if e not in from_host]
        cuda = store.device.type == "cuda"
        if cuda:
            stream = side_stream(store.device)
            # The staging may still be read by GEMMs queued on the compute stream.
            stream.wait_stream(torch.cuda.current_stream(store.device))
            context = torch.cuda.stream(stream)
        else:
            context = torch.no_grad()
        with context, torch.no_grad():
            self._copy(layer, runs, gathered, resident, non_blocking=cuda)
            if cuda:
                self._ready = torch.cuda.Event()
                self._ready.record(stream)
        self.experts |= from_host | set(gathered)

    def _copy(self, layer: int, runs: list[tuple[int, int]], gathered: list[int],
              resident: dict[int, int], non_blocking: bool) -> None:
        store = self.store
        staging = self.views(layer)
        host = store.host_layers(layer)
        for first, count in runs:
            for dst, src in zip(staging, host):
                dst[first: first + count].copy_(src[first: first + count],
                                                non_blocking=non_blocking)
        per_expert = store.bytes_of(layer)
        num_from_host = sum(count for _, count in runs)
        self.staged_experts[layer] += num_from_host
        self.staged_bytes[layer] += num_from_host * per_expert
        self.num_copy_calls += len(runs) * len(staging)
        gather(staging, store.slot_weights_of(layer), gathered, resident)
        self.gathered_bytes[layer] += len(gathered) * per_expert

    def status(self) -> dict:
        """The staging's size and what it moved, as plain values."""
        return {"staging_bytes": self.nbytes,
                "staged_experts": sum(self.staged_experts),
                "staged_bytes": sum(self.staged_bytes),
                "gathered_bytes": sum(self.gathered_bytes),
                "num_staged_copy_calls": self.num_copy_calls}
