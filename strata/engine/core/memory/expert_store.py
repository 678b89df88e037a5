"""ExpertStore: every expert in a host copy, N of them in VRAM slots, moved on demand.

The host copy holds, per MoE layer, the stacked projections gate [E, I, H], up [E, I, H] and
down [E, H, I]. The slot arena holds gate/up/down of N experts; `ExpertCache` decides which.
Quantized experts (sources with a GGML `qtype`) are held as their blocks: each projection is
then a uint8 [E, bytes] row per expert, and copies move blocks as stored;
`blocks(layer, weights)` views them as [.., N, row_bytes].

Layers whose experts differ in size (a Q4_K_M file mixes Q4_K and Q6_K down projections; an
IQ2_XXS one puts some in Q2_K) form slot classes: each class has its own slots, sized for its
experts, and its own pool of the cache (ExpertCache pools), its share of N in proportion to
its layers. One slot size for every layer would hold each small expert at the largest's size:
1.25 GB of a Q4_K_M Qwen3-30B-A3B's 17.5 GB of experts (docs/benchmarks.md, run 19).
The cache numbers slots globally (class c owns base_c ..); `slot_weights_of(layer)` are the
class's slots, indexed by the class-local numbers `fetch_slots` returns.
A device slot table [layers, E] (class-local slot, or -1) mirrors that decision for decode
kernels that read a missing expert in place from the host copy (fast/moe_triton.py);
expert_promotion.py moves the experts decode steps used into slots between steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from strata.engine.core.loader.lazy import as_lazy
from strata.engine.core.memory.arena import DEFAULT_CHUNK_BYTES, Arena
from strata.engine.core.memory.backend import ArenaBackend
from strata.engine.core.memory.expert_cache import ExpertCache, split_slots
from strata.engine.core.memory.expert_layout import (
    BlockFormat,
    SlotClass,
    as_blocks,
    contiguous_runs,
)
from strata.engine.core.memory.expert_staging import ExpertStaging, staging_bytes
from strata.engine.core.memory.expert_traffic import ExpertTraffic
from strata.engine.core.memory.host_copy import HostCopy, side_stream

ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down
# The most rows one decode step routes (a batch step: fast/batch_graph.MAX_BATCH_ROWS); each
# row's top-k ids land in step_ids[layer, row].
MAX_STEP_ROWS = 16


@dataclass(frozen=True)
class ExpertRefillResult:
    mapped_bytes: int
    copied_bytes: int
    seconds: float
    differing_slots: int | None  # set when STRATA_VERIFY_REFILL=1


class ExpertStore:
    """Host copy of all experts plus a VRAM slot arena; `fetch` returns what a step needs."""

    def __init__(
        self,
        layers: dict[int, ExpertWeights],
        num_slots: int,
        backend: ArenaBackend,
        num_layers: int | None = None,
        name: str = "experts",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_experts_per_tok: int = 1,
    ):
        if not layers:
            raise ValueError("ExpertStore needs the experts of at least one MoE layer")
        gate, up, down = next(iter(layers.values()))
        self.num_experts = gate.shape[0]
        self.layer_ids = sorted(layers)
        # layer -> (gate, up, down) BlockFormat when the experts stay quantized, else empty.
        self.formats: dict[int, tuple[BlockFormat, ...]] = {}
        if getattr(gate, "qtype", None) is not None:
            self._init_formats(layers)
            self.dtype = torch.uint8
            sizes = {layer: tuple((f.nbytes,) for f in self.formats[layer])
                     for layer in self.layer_ids}
        else:
            self.dtype = gate.dtype
            shapes = (tuple(gate.shape[1:]), tuple(up.shape[1:]), tuple(down.shape[1:]))
            self._check_float_layers(layers, shapes)
            sizes = dict.fromkeys(self.layer_ids, shapes)
        num_layers = num_layers if num_layers is not None else self.layer_ids[-1] + 1
        total = len(layers) * self.num_experts
        self.classes = self._slot_classes(sizes, min(num_slots, total))
        self.max_slots = sum(c.max_slots for c in self.classes)  # resize() uses fewer
        self.cache = ExpertCache(num_layers, self.num_experts, self.max_slots,
                                 pools=[(c.layers, c.max_slots) for c in self.classes])
        if not 0 < num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{self.num_experts}, "
                             f"not {num_experts_per_tok}")

        # Fill the host copy as ordinary memory, then pin it once (see host_copy.py); its
        # pages on the GPU's NUMA node, as the GPU reads misses from it in place.
        is_cuda = backend.device.type == "cuda"
        self.host = HostCopy(
            sum(len(c.layers) * self.num_experts * c.bytes_per_expert for c in self.classes),
            f"host copy of {name}",
            near_device=(backend.device.index or 0) if is_cuda else None,
        )
        self._host_layers: dict[int, list[torch.Tensor]] = {}
        offset = 0
        for layer in self.layer_ids:
            views = []
            for p, (shape, source) in enumerate(zip(self._class(layer).shapes,
                                                    layers[layer])):
                view = self.host.tensor(offset, (self.num_experts, *shape), self.dtype)
                # A tensor, or a file's handle read once; blocks into their rows.
                dst = as_blocks(view, self.formats[layer][p]) if self.formats else view
                as_lazy(source).copy_to(dst)
                views.append(view)
                offset += view.numel() * self.dtype.itemsize
            self._host_layers[layer] = views
        if is_cuda:
            self.host.pin(backend.device.index or 0)

        # A partial cache also holds one layer's experts whole for prefill chunks
        # (expert_staging.py), after the slots: mapped and budgeted with them.
        extra = 0 if self.max_slots >= total else self.staging_bytes_needed()
        self.arena = Arena(name, sum(c.max_slots * c.bytes_per_expert + 3 * 256
                                     for c in self.classes) + extra + 256, backend,
                           chunk_bytes)
        self.arena.map()
        for c in self.classes:
            c.weights = tuple(self.arena.allocate((c.max_slots, *shape), self.dtype)
                              for shape in c.shapes)
        self.staging = None if not extra else ExpertStaging(
            self, self.arena.allocate((extra // self.dtype.itemsize,), self.dtype), num_layers)
        # A store that held every expert at load and was shrunk live maps its staging in an
        # arena of its own (add_staging): the load's arena stays as it was.
        self.staging_arena: Arena | None = None
        # Allocated once (CUDA graphs keep their addresses), outside the arena: a release
        # unmaps the slots, never these. The mirror (the cache's global slot numbers) is
        # replaced, never written, on a change, so a step can keep the table it ran with
        # (ExpertPromotion counts its hits with it); the device table holds class-local ones.
        shape = (num_layers, self.num_experts)
        self.table = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        self.table_mirror = torch.full(shape, -1, dtype=torch.int32)
        self._layer_base = torch.zeros(num_layers, 1, dtype=torch.int32)
        for c, base in zip(self.classes, self.cache.bases):
            self._layer_base[c.layers] = base
        self.step_ids = torch.zeros(num_layers, MAX_STEP_ROWS, num_experts_per_tok,
                                    dtype=torch.long, device=self.device)
        self.traffic = ExpertTraffic(num_layers)  # copies, in-place reads, CPU-computed
        self.cpu_misses: Any = None  # the CpuMisses computing misses on the CPU, for status
        self.preload()

    def staging_bytes_needed(self) -> int:
        """What add_staging maps: one layer's experts whole, the largest class's."""
        return staging_bytes([c.proj_bytes for c in self.classes], self.num_experts)

    def add_staging(self) -> int:
        """Map a staging area for prefill chunks in an arena of its own (a store built with
        every expert resident has none; one shrunk live wants it); the bytes mapped (0: it
        has one). Raises ArenaMapError (nothing kept) when the memory is not there."""
        if self.staging is not None:
            return 0
        self.staging_arena, self.staging, mapped = ExpertStaging.in_own_arena(
            self, "expert_staging", self.staging_bytes_needed(), self.table.shape[0])
        return mapped

    def _check_float_layers(self, layers: dict[int, ExpertWeights],
                            shapes: tuple[tuple[int, ...], ...]) -> None:
        for layer, weights in layers.items():
            got = tuple(tuple(w.shape[1:]) for w in weights)
            if (
                got != shapes
                or any(w.shape[0] != self.num_experts for w in weights)
                or any(w.dtype != self.dtype for w in weights)
            ):
                raise ValueError(
                    f"layer {layer}: experts must all be [{self.num_experts}, ...] of "
                    f"{self.dtype} with shapes {shapes}, got "
                    f"{[tuple(w.shape) for w in weights]} of {[w.dtype for w in weights]}"
                )

    def _init_formats(self, layers: dict[int, ExpertWeights]) -> None:
        """Quantized sources: each projection's BlockFormat per layer."""
        logical = None
        for layer, weights in layers.items():
            formats = []
            for w in weights:
                qtype = getattr(w, "qtype", None)
                experts, _, row_bytes = w.shape
                if qtype is None or experts != self.num_experts or w.dtype != torch.uint8:
                    raise ValueError(f"layer {layer}: quantized experts must all be uint8 "
                                     f"[{self.num_experts}, N, row_bytes] blocks with a qtype")
                formats.append(BlockFormat(qtype, tuple(w.logical_shape[1:]), row_bytes))
            shapes = tuple(f.shape for f in formats)
            if logical is not None and shapes != logical:
                raise ValueError(f"layer {layer}: expert shapes {shapes} differ from {logical}")
            logical = shapes
            self.formats[layer] = tuple(formats)

    def _slot_classes(self, sizes: dict[int, tuple[tuple[int, ...], ...]],
                      num_slots: int) -> list[SlotClass]:
        """Layers grouped by their experts' slot shapes (first layer's order), num_slots
        shared among the groups (split_slots)."""
        groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for layer in self.layer_ids:
            groups.setdefault(sizes[layer], []).append(layer)
        counts = split_slots(num_slots, [len(g) for g in groups.values()], self.num_experts)
        return [SlotClass(members, shapes,
                          tuple(self._numel(shape) * self.dtype.itemsize for shape in shapes),
                          count)
                for (shapes, members), count in zip(groups.items(), counts)]

    @property
    def is_quantized(self) -> bool:
        return bool(self.formats)

    @property
    def num_slots(self) -> int:
        """Slots in use, every class together (resize() may use fewer than max_slots)."""
        return self.cache.num_slots

    @property
    def bytes_per_expert(self) -> int:
        """What one slot holds on average over the classes (the exact size with one class):
        what a caller sizing or shrinking the cache by bytes divides by."""
        slot_bytes = sum(c.max_slots * c.bytes_per_expert for c in self.classes)
        return -(-slot_bytes // self.max_slots)

    @property
    def slot_weights(self) -> ExpertWeights:
        """The slots of a store whose layers' experts all have one size."""
        if len(self.classes) != 1:
            raise ValueError(f"{len(self.classes)} slot classes: take slot_weights_of(layer)")
        return self.classes[0].weights  # type: ignore[return-value]

    def slot_weights_of(self, layer: int) -> ExpertWeights:
        """The slots that layer's experts take, [n, ...] per projection (class-local slots)."""
        return self._class(layer).weights  # type: ignore[return-value]

    def local_slot(self, layer: int, slot: int) -> int:
        """The cache's slot number as an index of slot_weights_of(layer)."""
        return slot - self.cache.bases[self.cache.pool_of(layer)]

    def _class(self, layer: int) -> SlotClass:
        return self.classes[self.cache.pool_of(layer)]  # the cache's pools are the classes

    def blocks(self, layer: int, weights: Sequence[torch.Tensor]) -> ExpertWeights:
        """Quantized stores: each of weights' [n, bytes] uint8 (slots or a layer's host copy)
        viewed as layer's [n, N, row_bytes] blocks."""
        return tuple(as_blocks(w, f)  # type: ignore[return-value]
                     for w, f in zip(weights, self.formats[layer]))

    @staticmethod
    def _numel(shape: tuple[int, ...]) -> int:
        numel = 1
        for dim in shape:
            numel *= dim
        return numel

    @property
    def device(self) -> torch.device:
        return self.arena.device

    @property
    def is_all_resident(self) -> bool:
        return self.num_slots >= len(self.layer_ids) * self.num_experts

    def host_layers(self, layer: int) -> list[torch.Tensor]:
        """The host copy of layer's experts: gate, up and down, [E, ...] each."""
        return self._host_layers[layer]

    def host_expert(self, layer: int, expert: int) -> ExpertWeights:
        """The host copy of one expert's gate, up and down."""
        gate, up, down = self._host_layers[layer]
        return gate[expert], up[expert], down[expert]

    def host_offsets(self, layer: int) -> tuple[int, int, int] | None:
        """Elements from each of layer's slot weights' base (gate, up, down) to this layer's
        host copy [E, ...] as the device addresses it; None when a GPU cannot read the host
        copy."""
        offsets = []
        for host, slots in zip(self._host_layers[layer], self.slot_weights_of(layer)):
            address = self.host.device_address_of(host)
            if address is None:
                return None
            delta = address - slots.data_ptr()
            # Blocks are read with their fp16 fields as halves: an even distance keeps them so.
            if delta % max(self.dtype.itemsize, 2 if self.formats else 1):
                raise RuntimeError(f"layer {layer}'s host copy is not {self.dtype} aligned")
            offsets.append(delta // self.dtype.itemsize)
        return tuple(offsets)  # type: ignore[return-value]

    def update_table(
        self, cleared_slots: Sequence[int] = (), entries: Sequence[tuple[int, int, int]] = ()
    ) -> None:
        """Set the table entries of experts whose slots (the cache's numbers) now hold
        something else to -1, then (layer, expert) -> slot for `entries`, and publish it on
        the compute stream (after every copy queued there before)."""
        # In numpy: a prefetch publishes at every MoE layer of a token (fast/moe_prefetch.py),
        # where torch's per-op costs made this ~110 us (a few, by numpy).
        mirror = self.table_mirror.numpy().copy()
        flat = mirror.reshape(-1)
        slots = [*cleared_slots, *(slot for _, _, slot in entries)]
        if len(slots) <= 16:  # a few compares beat isin's sort
            for slot in slots:
                flat[flat == slot] = -1
        else:
            flat[np.isin(flat, np.asarray(slots, dtype=np.int32))] = -1
        if entries:
            layers, experts, new_slots = zip(*entries)
            mirror[list(layers), list(experts)] = new_slots
        self.table_mirror = torch.from_numpy(mirror)
        # The device table holds class-local slot numbers (indices of slot_weights_of(layer)).
        local = torch.from_numpy(np.where(mirror >= 0, mirror - self._layer_base.numpy(), -1)
                                 .astype(np.int32))
        if self.device.type == "cuda":
            # From pinned staging, so the host never waits; torch's pinned pool keeps the
            # buffer until this copy has run.
            self.table.copy_(local.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(local)

    def copy_rows(self, assignments: Sequence[tuple[int, int, int]], non_blocking: bool) -> None:
        """Copy (layer, expert) -> slot (the cache's numbers) from the host copy on the
        current stream.

        Experts that follow each other in a layer and land in slots that follow each other go
        as one copy per weight: a refill of 14 layers x 128 experts was 5376 copies of 3 MiB,
        where pinned copies reach PCIe's rate only from ~16 MiB (H200: 46-48 GB/s of 55).
        Timed: device events on the current stream (read by status once done), or the wall
        clock for synchronous copies."""
        nbytes = sum(self.bytes_of(layer) for layer, _, _ in assignments)
        if not nbytes:
            return
        with self.traffic.timed_copies(self.device.type == "cuda", nbytes):
            self._copy_runs(assignments, non_blocking)

    def _copy_runs(self, assignments: Sequence[tuple[int, int, int]],
                   non_blocking: bool) -> None:
        for layer, expert, slot, count in contiguous_runs(assignments):
            self.traffic.note_copy(layer, count * self._class(layer).bytes_per_expert,
                                   len(self._host_layers[layer]))
            first = self.local_slot(layer, slot)
            for dst, src in zip(self.slot_weights_of(layer), self._host_layers[layer]):
                dst[first : first + count].copy_(src[expert : expert + count],
                                                 non_blocking=non_blocking)

    def preload(self) -> None:
        """Fill every slot, layer by layer, so the first steps do not all miss."""
        room = self.cache.sizes  # nothing resident yet: called once, by __init__
        for layer in self.layer_ids:
            pool = self.cache.pool_of(layer)
            if room[pool] <= 0:
                continue
            experts = range(min(room[pool], self.num_experts))
            _, misses = self.cache.lookup(layer, experts)
            self._copy_in([(layer, e, s) for e, s in misses])
            room[pool] -= len(experts)

    def fetch_slots(self, layer: int, expert_ids: Sequence[int] | torch.Tensor) -> list[int]:
        """Slots holding the requested experts, copying misses in; index
        `slot_weights_of(layer)` with them to use the experts without a gather copy."""
        self.check_mapped()  # a released cache must be refilled, never read
        if self.device.type == "cuda":
            # A hit may be an expert whose promotion copy (side stream) is still on the way.
            torch.cuda.current_stream(self.device).wait_stream(side_stream(self.device))
        if isinstance(expert_ids, torch.Tensor):
            expert_ids = expert_ids.flatten().tolist()
        if layer not in self._host_layers:
            raise ValueError(f"layer {layer} has no experts in this store (dense layer?)")
        slots, misses = self.cache.lookup(layer, expert_ids)
        self._copy_in([(layer, e, s) for e, s in misses])
        return [self.local_slot(layer, slot) for slot in slots]

    def fetch(self, layer: int, expert_ids: Sequence[int] | torch.Tensor) -> ExpertWeights:
        """gate [k, I, H], up [k, I, H], down [k, H, I] for the k requested experts."""
        slots = self.fetch_slots(layer, expert_ids)
        index = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
        gate, up, down = (w.index_select(0, index) for w in self.slot_weights_of(layer))
        return gate, up, down

    def _copy_in(self, assignments: list[tuple[int, int, int]]) -> int:
        """Copy (layer, expert) -> slot from the host copy; returns bytes copied."""
        if not assignments:
            return 0
        cuda = self.device.type == "cuda"
        if cuda:
            stream = side_stream(self.device)
            # An evicted slot may still be read by kernels queued on the compute stream.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            context: Any = torch.cuda.stream(stream)
        else:
            context = torch.no_grad()
        with context:
            self.copy_rows(assignments, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.update_table(entries=assignments)  # queued after the copies it announces
        return sum(self._class(layer).bytes_per_expert for layer, _, _ in assignments)

    def _slot_ranges(self, sizes: Sequence[int], new_sizes: Sequence[int]
                     ) -> list[tuple[int, int]]:
        """(arena offset, bytes) of each class's slots sizes[c]..new_sizes[c]-1 in each of
        gate, up and down (classes whose count does not grow give none)."""
        base = self.arena.base_address
        return [(weights.data_ptr() - base + first * nbytes, (end - first) * nbytes)
                for c, first, end in zip(self.classes, sizes, new_sizes) if end > first
                for weights, nbytes in zip(c.weights, c.proj_bytes)]

    def check_mapped(self) -> None:
        """Raise ArenaReleasedError unless the slots in use are mapped."""
        if self.num_slots == self.max_slots:
            self.arena.check_mapped()
            return
        for offset, nbytes in self._slot_ranges([0] * len(self.classes), self.cache.sizes):
            self.arena.check_mapped(offset, nbytes)

    def _clamp_slots(self, num_slots: int) -> int:
        """What resize() makes of num_slots: num_experts..max_slots."""
        return max(min(num_slots, self.max_slots), min(self.num_experts, self.max_slots))

    def mapped_bytes_at(self, num_slots: int) -> int:
        """VRAM the slot arena maps once resized to num_slots: whole chunks, so a chunk that
        holds one slot in use (of any class and projection) stays mapped, and with it the
        slots past the new count that share it. num_slots x bytes_per_expert is less by up
        to a chunk per class and projection (6 x 512 MiB chunks for a Q4_K_M Qwen3-30B-A3B
        was 1.3 GiB over a budget: docs/benchmarks.md, run 33b)."""
        sizes = self.cache.pool_sizes(self._clamp_slots(num_slots))
        return self.arena.bytes_kept_by(self._slot_ranges(sizes, self.cache.max_sizes))

    def slots_within(self, nbytes: int) -> int:
        """The most slots whose mapped_bytes_at fits nbytes (at least one layer's experts of
        each class, which may not fit: then that floor)."""
        low, high = self._clamp_slots(0), self.max_slots
        if self.mapped_bytes_at(high) <= nbytes:
            return high
        while low < high:  # mapped bytes grow with the slots: the last count that fits
            middle = (low + high + 1) // 2
            if self.mapped_bytes_at(middle) <= nbytes:
                low = middle
            else:
                high = middle - 1
        return low

    def resize(self, num_slots: int) -> dict[str, Any]:
        """Use about num_slots slots (num_experts..max_slots, shared by the classes as the
        cache's pools say): shrinking frees the chunks wholly above each class's new count
        (the experts there are read from the host copy again); growing maps them back, empty
        (misses fill them). Raises ArenaMapError (nothing changed) when growing finds too
        little VRAM."""
        num_slots = self._clamp_slots(num_slots)
        old, new = self.cache.sizes, self.cache.pool_sizes(num_slots)
        freed = mapped = 0
        done: list[tuple[int, int]] = []
        try:
            for offset, nbytes in self._slot_ranges(old, new):  # the classes that grow
                mapped += self.arena.map_range(offset, nbytes)
                done.append((offset, nbytes))
        except BaseException:
            for offset, nbytes in done:
                self.arena.release_range(offset, nbytes)
            raise
        self.update_table(cleared_slots=self.cache.resize(num_slots))
        # Everything past each class's new count, not only what this call drops: the arena
        # frees whole chunks, and a chunk that straddled an earlier count is now wholly
        # unused (released chunks are skipped). Release syncs the device first: no queued
        # step still reads those slots.
        for offset, nbytes in self._slot_ranges(new, self.cache.max_sizes):
            freed += self.arena.release_range(offset, nbytes)
        return {"num_slots": self.num_slots, "max_slots": self.max_slots,
                "freed_bytes": freed, "mapped_bytes": mapped,
                "resident_bytes": self.arena.resident_bytes}

    def release(self) -> int:
        """Give the slots' VRAM back, remembering who was resident; returns bytes freed."""
        self.cache.mark_all_released()
        freed = self.arena.release()
        if self.staging_arena is not None:
            freed += self.staging_arena.release()
        if self.staging is not None:
            self.staging.forget()
        self.table_mirror = torch.full_like(self.table_mirror, -1)
        self.table.fill_(-1)  # refill publishes who came back
        return freed

    def refill(self) -> ExpertRefillResult:
        """Map the slots again and copy back the experts that were resident at the release.

        Raises ArenaMapError (state unchanged: still released) when VRAM is short."""
        t0 = time.perf_counter()
        mapped_bytes = self.arena.refill(copy_from_host=False).mapped_bytes
        if self.staging_arena is not None:
            try:
                mapped_bytes += self.staging_arena.refill(copy_from_host=False).mapped_bytes
            except BaseException:
                self.arena.release()  # still released as a whole
                raise
        restored = self.cache.restore_residency()
        if self.num_slots < self.max_slots:  # shrunk before the release: back to every slot
            self.cache.resize(self.max_slots)
        try:
            copied_bytes = self._copy_in(restored)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            self.release()
            raise
        differing = self.verify_slots() if os.environ.get("STRATA_VERIFY_REFILL") == "1" else None
        return ExpertRefillResult(
            mapped_bytes, copied_bytes, time.perf_counter() - t0, differing
        )

    def verify_slots(self) -> int:
        """Read every resident slot back and compare with its host copy; the number that differ."""
        self.arena.check_mapped()
        differing = 0
        for layer, expert, slot in self.cache.resident():
            local = self.local_slot(layer, slot)
            for slot_weight, host in zip(self.slot_weights_of(layer),
                                         self.host_expert(layer, expert)):
                if not torch.equal(slot_weight[local], host.to(self.device)):
                    differing += 1
                    break
        return differing

    def bytes_of(self, layer: int) -> int:
        """One expert of layer: gate, up and down as its slot class holds them."""
        return self._class(layer).bytes_per_expert

    def count_host_reads(self, layers: Sequence[int], num_misses: Sequence[int],
                         num_on_cpu: Sequence[int] | None = None) -> None:
        """Note a step's misses read in place, less those the CPU computed (traffic's)."""
        self.traffic.count_host_reads(layers, num_misses,
                                      [self._class(layer).bytes_per_expert for layer in layers],
                                      num_on_cpu)

    def status(self) -> dict[str, Any]:
        """Slots, residency counters, arena bytes and host-to-device traffic, as plain
        values; `layers` has each MoE layer's hits, misses and bytes moved."""
        cache = self.cache
        return {
            **cache.stats(),
            "bytes_per_expert": self.bytes_per_expert,
            "max_slots": self.max_slots,
            "total_experts": len(self.layer_ids) * self.num_experts,  # all resident
            "is_all_resident": self.is_all_resident,
            "state": self.arena.state,
            "resident_bytes": self.arena.resident_bytes,
            **self.traffic.status(),
            **(self.cpu_misses.status() if self.cpu_misses is not None else {}),
            "host_numa": self.host.placement.as_status(),  # where the host copy's pages sit
            # Prefill chunks' staging (expert_staging.py): 0 and no traffic when all resident.
            **(self.staging.status() if self.staging is not None else {
                "staging_bytes": 0, "staged_experts": 0, "staged_bytes": 0,
                "gathered_bytes": 0, "num_staged_copy_calls": 0}),
            "layers": [{"layer": layer, "num_hits": cache.layer_hits[layer],
                        "num_misses": cache.layer_misses[layer],
                        "num_left_out": cache.layer_left_out[layer],
                        **self.traffic.layer_status(layer),
                        "staged_bytes": (self.staging.staged_bytes[layer]
                                         if self.staging is not None else 0)}
                       for layer in self.layer_ids],
        }

    def close(self) -> None:
        """Free the slot arena (and a live shrink's staging arena) and the host copy."""
        self.arena.close()
        if self.staging_arena is not None:
            self.staging_arena.close()
        self.host.close()
