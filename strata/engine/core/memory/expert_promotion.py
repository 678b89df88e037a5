"""Promotion of the experts decode steps used into a partial expert cache, between steps.

A decode step (one CUDA graph, no host sync) reads each routed expert from its slot when the
device slot table has one, else in place from the pinned host copy, and its router leaves the
ids in `ExpertStore.step_ids` (row b of a batch step in [layer, b]). Around each step, never
inside it:

- after_step: copy the step's ids (its real rows) to pinned host memory behind an event.
- before_step, for steps whose ids have arrived: count hits (the table the step ran with
  had a slot) and misses per layer, and the host bytes the misses read in place, let
  ExpertCache choose slots (its policy; a miss that does not outrank the expert it would
  evict stays on the host: one read, no copy), publish the table with
  the evicted experts at -1 first, then copy the new experts in on the side stream once the
  compute stream has passed that point; for copies that have landed, publish their slots,
  each only if the cache still maps that expert there (a later choice may have taken it).

- fill: free slots (a grown cache's, mapped empty) get the most used experts that are not
  resident, one chunk of FILL_CHUNK_BYTES at a time, copied and published as promotions
  are; before_step queues the next chunk once the last has landed, and the engine process
  runs fill_step while idle (Engine.run_deferred_step).

ExpertCache decides, the table mirrors it: an entry is never published before its copy.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.memory.host_copy import side_stream
from strata.units import MIB

# Free slots filled a chunk at a time (fill): ~5 ms of a 50 GB/s link. A prefill's staging
# copies share the side stream and so wait behind at most one chunk, and decode's in-place
# reads share the link with one chunk at a time, where a grow of 8 GiB queued whole would
# hold the side stream for ~170 ms.
FILL_CHUNK_BYTES = 256 * MIB


@dataclass
class _RoutedStep:
    ids: torch.Tensor  # [layers, rows, k] on the host (pinned on a GPU), once `ready` is done
    ready: torch.cuda.Event | None  # None: the CPU, where copies are done on return
    table: torch.Tensor  # the host mirror of the table the step ran with
    cpu_experts: list[int]  # per layer, the misses the CPU computed (moe_cpu_misses.py)


@dataclass
class _Promotion:
    assignments: list[tuple[int, int, int]]  # (layer, expert, slot)
    copied: torch.cuda.Event | None


def _is_done(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


class ExpertPromotion:
    """Between decode steps: learn which experts a step used (without waiting for it), count
    hits and misses in the store's ExpertCache, and copy missed experts into slots."""

    def __init__(self, store: ExpertStore):
        if store.host.device_address is None:
            raise ValueError(f"{store.host.name} is not readable by the device (not pinned: "
                             f"{store.host.pin_note}); decode must use the MoE loop")
        self.store = store
        self.is_cuda = store.device.type == "cuda"
        self._steps: deque[_RoutedStep] = deque()
        self._promotions: deque[_Promotion] = deque()
        # A step that changed the table between its layers (a prefetch: fast/moe_prefetch.py)
        # ran each of those layers with the row noted here, not the table after it.
        self._rows: dict[int, torch.Tensor] = {}
        self._fill: _Promotion | None = None  # the fill chunk last queued

    @property
    def num_in_flight(self) -> int:
        """Experts whose copy into a slot has been queued but not yet published."""
        return sum(len(p.assignments) for p in self._promotions)

    def before_step(self) -> None:
        """Refuse a released cache (a step would read unmapped slots), then act on what the
        finished steps and copies have made known."""
        self.store.check_mapped()
        self.store.traffic.take_cpu_experts()  # since the last step: a prefill's, no step's
        self.collect()
        self.land()
        self.fill()

    def after_step(self, num_rows: int = 1) -> None:
        """The step of num_rows rows (a batch step's real ones; padding rows after them) is
        queued: fetch its routed ids behind it, without waiting."""
        if self.is_cuda:
            # All rows (a contiguous 50 KB for 48 layers), sliced on the host.
            ids = self.store.step_ids.to("cpu", non_blocking=True)  # pinned, torch's pool
            ready = torch.cuda.Event()
            ready.record()
        else:
            ids, ready = self.store.step_ids.clone(), None
        ids = ids[:, :num_rows]
        table = self.store.table_mirror
        if self._rows:
            table = table.clone()
            for layer, row in self._rows.items():
                table[layer] = row
            self._rows.clear()
        self._steps.append(_RoutedStep(ids, ready, table, self.store.traffic.take_cpu_experts()))

    def note_row(self, layer: int, row: torch.Tensor) -> None:
        """The table row layer ran with in the step now queued, where the table changes
        between its layers (the mirror's rows are replaced, never written: no copy)."""
        self._rows[layer] = row

    def collect(self) -> None:
        """For every step whose ids have arrived: count, choose slots, start the copies."""
        assignments: list[tuple[int, int, int]] = []
        while self._steps and _is_done(self._steps[0].ready):
            assignments += self._choose_slots(self._steps.popleft())
        cache = self.store.cache
        # A later step's (or layer's) choice may have evicted an expert chosen before it.
        assignments = [a for a in assignments if cache.slot_of(a[0], a[1]) == a[2]]
        if assignments:
            self.start_copies(assignments)

    def _choose_slots(self, step: _RoutedStep) -> list[tuple[int, int, int]]:
        cache = self.store.cache
        layers = self.store.layer_ids
        routed = step.ids[layers].flatten(1)  # [MoE layers, rows * k]
        assignments = []
        for layer, experts in zip(layers, routed.tolist()):
            # Rows of a batch share experts (one row's top-k ids differ); a step may want more
            # than fit, and the rest stay on the host, where the step read them.
            used = list(dict.fromkeys(experts))[: cache.pool_slots(layer)]
            # Checks the ids, counts the uses, gives misses slots where they outrank the
            # expert they would evict (the step read them from the host copy already).
            _, new = cache.lookup(layer, used, count_uses=False, admit_all=False)
            assignments += [(layer, expert, slot) for expert, slot in new]
        # Where the step read each routed expert, once however many rows routed there: its
        # slot (a hit) or the host copy (a miss), by the table it ran with. A few tensor ops
        # a step, not a few per layer: this runs every token.
        read_slot = step.table[layers].gather(1, routed) >= 0  # [MoE layers, rows * k]
        first = ~(routed[:, :, None] == routed[:, None, :]).tril(-1).any(dim=2)  # no repeat
        reads, hits = first.sum(dim=1).tolist(), (read_slot & first).sum(dim=1).tolist()
        for layer, num_reads, num_hits in zip(layers, reads, hits):
            cache.count(num_hits, num_reads - num_hits, layer)
        self.store.count_host_reads(layers, [r - h for r, h in zip(reads, hits)],
                                    [step.cpu_experts[layer] for layer in layers])
        return assignments

    def start_copies(self, assignments: list[tuple[int, int, int]],
                     after: torch.cuda.Event | None = None) -> None:
        """Publish the evicted experts' entries at -1, then copy (layer, expert, slot) in on
        the side stream behind `after` (default: everything queued now); `land` publishes
        them. A caller passing `after` guarantees that nothing queued since reads the
        slots taken (a prefetch: only experts it kept from eviction)."""
        store = self.store
        # Evicted experts are read from the host from the next step on; only after every
        # step that may still read their slots may the copies overwrite them.
        store.update_table(cleared_slots=[slot for _, _, slot in assignments])
        if not self.is_cuda:
            store.copy_rows(assignments, non_blocking=False)
            self._promotions.append(_Promotion(assignments, None))
            return
        compute, side = torch.cuda.current_stream(store.device), side_stream(store.device)
        if after is None:
            after = torch.cuda.Event()
            after.record(compute)
        side.wait_event(after)
        with torch.cuda.stream(side):
            store.copy_rows(assignments, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(side)
        self._promotions.append(_Promotion(assignments, copied))

    @property
    def is_filling(self) -> bool:
        """Whether free slots wait for a fill, or its last chunk is not yet published."""
        return (self.store.cache.num_free > 0
                or any(p is self._fill for p in self._promotions))

    def fill(self, max_bytes: int = FILL_CHUNK_BYTES) -> int:
        """Queue the next chunk of free slots' fill (ExpertCache.fill_free, about max_bytes)
        on the side stream once the last chunk has landed; land() publishes it. The number
        of experts queued: 0 while a chunk is on the way or no slot is free."""
        cache = self.store.cache
        # No free slot first: every decode step asks, and that is a length, not an event query.
        if not cache.num_free:
            return 0
        # A landed chunk stays `_fill` until the next one: is_filling holds until land()
        # has published it, so the idle steps do not stop one chunk short.
        if self._fill is not None and not _is_done(self._fill.copied):
            return 0
        assignments = cache.fill_free(max(1, max_bytes // self.store.bytes_per_expert))
        if assignments:  # behind the queued step, as a promotion: at most a step's wait
            self.start_copies(assignments)
            self._fill = self._promotions[-1]
        return len(assignments)

    def fill_step(self) -> int:
        """Idle (no step to drive before_step): wait for the chunk on the way, publish what
        landed, queue the next chunk; the experts queued."""
        if self._fill is not None and self._fill.copied is not None:
            self._fill.copied.synchronize()
        self.land()
        return self.fill()

    def land(self) -> None:
        """Publish the slots of promotions whose copies have completed (never waits)."""
        cache = self.store.cache
        entries = []
        while self._promotions and _is_done(self._promotions[0].copied):
            promotion = self._promotions.popleft()
            if promotion.copied is not None:  # formal order for the kernels that read them
                torch.cuda.current_stream(self.store.device).wait_event(promotion.copied)
            entries += [a for a in promotion.assignments if cache.slot_of(a[0], a[1]) == a[2]]
        if entries:
            self.store.update_table(entries=entries)
