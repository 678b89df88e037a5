"""The model's weights and experts in arenas, and the levels that release and bring them back.

- "weights": every dense tensor (embeddings, attention, norms, dense MLPs, routers, lm_head),
  laid out once at load; the model's parameters are views of it. A host copy (pinned once on
  a GPU) is what wake() copies back. With the expert cache off the experts live here too.
  q/k/v and gate/up lie back to back, so fused views span them (fused_views.py).
- "experts": an ExpertStore. `all` keeps every expert resident and the model's stacked expert
  parameters are views of its slots (no per-call copy, CUDA-graph friendly); `N` slots is an
  LRU cache whose misses are copied in from the host copy through a provider per layer.
Quantized GGUF tensors with a kernel stay in their blocks in both (and in the host copies);
experts do when every expert tensor of the model has a kernel (quant/experts.py).
Addresses never change: release and refill map and unmap physical memory under fixed views.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from strata.engine.core import load_phases
from strata.engine.core.cpu_miss_setting import CpuMissSetting
from strata.engine.core.engine_config import DEFAULT_CPU_EXPERT_CACHE_BYTES, parse_expert_cache
from strata.engine.core.engine_errors import EngineError, EngineOutOfMemory, LevelNotApplicable
from strata.engine.core.expert_warmup import expert_scratch_numel, warm_up_experts
from strata.engine.core.expert_wiring import expert_names, unwire
from strata.engine.core.fused_views import attach_fused_views, fusion_order, same_group
from strata.engine.core.loader.quant_plan import has_kernel, is_quantizable
from strata.engine.core.memory.arena import Arena, ArenaMapError
from strata.engine.core.memory.arena_set import ArenaSet
from strata.engine.core.memory.backend import ArenaBackend, round_up
from strata.engine.core.memory.budget import budget_free_bytes
from strata.engine.core.memory.expert_cache import size_slots
from strata.engine.core.memory.expert_promotion import ExpertPromotion
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.memory.host_copy import HostCopy
from strata.engine.core.memory.vram import read_free_vram_bytes
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.build import build_model, parameter_dtype
from strata.engine.core.models.registry import model_module
from strata.engine.core.models.switch import SparseMoE
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.quant.weight import (
    QuantizedWeight,
    block_shape,
    keeps_quantized_blocks,
    prefill_scratch_numel,
    reserve_scratch,
    warm_up_quantized,
)
from strata.engine.core.slot_experts import SlotExperts, quantized_experts
from strata.units import GIB, MIB

if TYPE_CHECKING:
    from strata.engine.core.fast.moe_cpu_misses import CpuMisses

log = logging.getLogger(__name__)

WEIGHTS_CHUNK_BYTES = 512 * MIB  # 16 GiB unmaps in ~10 ms at this size (DESIGN §8)
# The expert slots shrink and grow with a budget, freeing whole chunks: each class and
# projection keeps the chunk its last slot in use lies in (6 x 512 MiB held 1.3 GiB over an
# 8 GiB budget, run 33b). 128 MiB keeps that under 0.75 GiB worst case; 16 GiB then unmaps
# in ~13 ms by DESIGN §8's figures (~31 us a chunk + ~9 ms for the bytes), estimated, not
# measured. Sizing by mapped bytes (ExpertStore.slots_within) keeps a budget exact.
EXPERTS_CHUNK_BYTES = 128 * MIB
EXPERT_RESERVE_BYTES = 2 * GIB  # left free by --expert-cache auto: KV and activations
TENSOR_ALIGN_BYTES = 256

# One GPU page of an unmapped arena read by a kernel kills the CUDA context; these messages
# are what a caller sees instead.
ASLEEP = "the model is asleep: wake it first"
EXPERTS_RELEASED = "the expert cache is released: refill it first"


class ModelMemory:
    """Builds a model over arenas and moves its weights and experts between VRAM and host."""

    def __init__(self, backend: ArenaBackend, dtype: torch.dtype,
                 cpu_expert_misses: str = "off",
                 cpu_expert_cache_bytes: int = DEFAULT_CPU_EXPERT_CACHE_BYTES):
        """cpu_expert_misses, cpu_expert_cache_bytes: see CpuMissSetting."""
        self.cpu_miss_setting = CpuMissSetting(cpu_expert_misses, cpu_expert_cache_bytes)
        self.backend = backend
        self.device = backend.device
        self.dtype = dtype
        self.arenas = ArenaSet()
        self.weights: Arena | None = None
        self.experts: ExpertStore | None = None
        self.expert_mode = "none"  # none (dense) | off | all | slots
        # Slots mode with a host copy the GPU reads in place: decode's step hook.
        self.promotion: ExpertPromotion | None = None
        self._fill_failed = False  # an idle fill step raised: no more idle fill (fill_step)
        # All mode: each MoE layer's module, given a SlotExperts when a shrink switches the
        # model to the partial cache while it serves (switch_to_slots).
        self._moe_layers: dict[int, SparseMoE] = {}
        self.is_sleeping = False

    # ---- load ---------------------------------------------------------------------------

    def build(self, config: ModelConfig, source: Any, expert_cache: str,
              max_prefill_tokens: int | None = None) -> torch.nn.Module:
        """Lay the weights out in arenas, fill them from `source` (weight_source.py), build
        the model over the views. The caller owns `source` and drops it afterwards.
        max_prefill_tokens: the longest chunk a prefill runs (None: no bound), which says
        whether the dequantize-then-grouped expert path and its scratch are ever used."""
        with torch.device("meta"):
            meta = model_module(config.model_type).Model(config)
        shapes = {name: tuple(p.shape) for name, p in meta.named_parameters()}
        source.check(shapes)
        by_layer = expert_names(meta)
        spec = parse_expert_cache(expert_cache)
        self.expert_mode = "none" if not by_layer else "off" if spec == "off" else "store"
        in_store = {n for names in by_layer.values() for n in names}
        if self.expert_mode != "store":
            in_store = set()
        dense = [n for n in shapes if n not in in_store]

        expert_blocks = self._kept_expert_blocks(source, by_layer, shapes)
        blocks = self._kept_blocks(dense, source, shapes)
        if self.expert_mode == "off":  # experts in the weights arena, as blocks where kept
            blocks.update(expert_blocks)
        views = self._fill_weights(dense, shapes, source, blocks)
        quantized = {name: _quantized(qtype, shapes[name], views.pop(name), self.dtype)
                     for name, qtype in blocks.items()}
        placeholders: set[str] = set()
        if self.expert_mode == "store":
            if expert_blocks:
                layers = source.experts(by_layer, shapes, self.dtype, quantized=True)
            else:
                layers = source.experts(by_layer, shapes, self.dtype)
            per_expert, num_classes, largest = self._bytes_per_expert(shapes, by_layer,
                                                                      expert_blocks)
            num_slots = self._expert_slots(spec, config, len(by_layer), per_expert,
                                           num_classes, config.num_experts * largest)
            self.experts = ExpertStore(
                layers, num_slots, self.backend, num_layers=config.num_hidden_layers,
                chunk_bytes=EXPERTS_CHUNK_BYTES, num_experts_per_tok=config.num_experts_per_tok,
            )
            del layers
            self.arenas.add(self.experts.arena)
            if self.experts.is_all_resident:
                self.expert_mode = "all"
                resident = self._resident_expert_views(by_layer)
                target = quantized if self.experts.is_quantized else views
                target.update(resident)
            else:
                self.expert_mode = "slots"
                placeholders = in_store
        with load_phases.phase("build_model"):
            model = build_model(config, views, self.device, self.dtype,
                                placeholders=placeholders, quantized=quantized)
            fused = attach_fused_views(model, self.weights)
        log.debug("fused views: %d qkv, %d gate_up", fused["qkv"], fused["gate_up"])
        if self.expert_mode == "slots":
            self._use_slots({layer: model.model.layers[layer].mlp for layer in by_layer})
        elif self.expert_mode == "all":
            self._moe_layers = {layer: model.model.layers[layer].mlp for layer in by_layer}
        if quantized or expert_blocks:
            self._warm_up_quantized(model, max_prefill_tokens)
        return model

    @property
    def cpu_misses(self) -> CpuMisses | None:
        """The partial cache's CPU-computed misses, once made."""
        return self.cpu_miss_setting.cpu_misses

    def _cpu_misses(self) -> CpuMisses | None:
        return self.cpu_miss_setting.for_store(self.experts, self.dtype)

    def _warm_up_quantized(self, model: torch.nn.Module, max_prefill_tokens: int | None) -> None:
        with load_phases.phase("warm_up"):
            # Prefill dequantizes one matrix (or one projection of a layer's resident experts)
            # at a time into this buffer: sized now, before any CUDA graph is captured.
            reserve_scratch(self.device, self.dtype, max(
                prefill_scratch_numel(model), expert_scratch_numel(model, max_prefill_tokens)))
            if self.device.type == "cuda":
                t0 = time.perf_counter()
                variants = warm_up_quantized(model) + warm_up_experts(model, max_prefill_tokens)
                log.info("quantized kernels ready: %d variants in %.1f s", variants,
                         time.perf_counter() - t0)

    def _kept_blocks(self, names: list[str], source: Any,
                     shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """name -> GGML type of the dense tensors that stay in their blocks in the weights
        arena; a quantized tensor no kernel reads here is dequantized, with one log line."""
        if not keeps_quantized_blocks(self.device):
            return {}
        kept = {}
        for name in names:
            qtype = source.quant_type(name)
            if qtype is None or ".mlp.experts." in name:  # experts: _kept_expert_blocks
                continue
            if has_kernel(qtype.name, shapes[name][-1]) and is_quantizable(name):
                kept[name] = qtype
            else:
                log.info("tensor %s (%s) has no quantized kernel here: dequantized to %s",
                         name, qtype.name, str(self.dtype).removeprefix("torch."))
        return kept

    def _kept_expert_blocks(self, source: Any, by_layer: dict[int, tuple[str, str, str]],
                            shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """name -> GGML type of every stacked expert tensor, when all stay in their blocks:
        the store's slots hold any layer's experts, so it holds blocks or floats, not both.
        Otherwise {} and one log line naming the types dequantized."""
        names = [n for layer_names in by_layer.values() for n in layer_names]
        types = {name: source.quant_type(name) for name in names}
        quantized = sorted({t.name for t in types.values() if t is not None})
        if not quantized:
            return {}
        if keeps_quantized_blocks(self.device) and all(
                t is not None and has_kernel(t.name, shapes[n][-1]) for n, t in types.items()):
            return types
        if keeps_quantized_blocks(self.device):
            log.info("experts of %d layers (%s) are dequantized to %s: one expert store "
                     "holds blocks only when every expert tensor has a quantized kernel",
                     len(by_layer), ", ".join(
                         sorted({t.name if t else "float" for t in types.values()})),
                     str(self.dtype).removeprefix("torch."))
        return {}

    def _bytes_per_expert(self, shapes: dict[str, tuple[int, ...]],
                          by_layer: dict[int, tuple[str, str, str]],
                          blocks: dict[str, Any]) -> tuple[int, int, int]:
        """(What one expert slot holds on average over the layers, the number of slot
        classes, the largest expert's bytes): gate, up and down in the compute dtype, or as
        each layer stores their blocks; layers of different sizes take slots of their own
        (expert_store.py)."""
        sizes = []
        for names in by_layer.values():
            size = tuple(torch.Size(block_shape(blocks[n], shapes[n][1:]) if blocks
                                    else shapes[n][1:]).numel() for n in names)
            sizes.append(size)
        itemsize = 1 if blocks else self.dtype.itemsize
        return (-(-sum(map(sum, sizes)) * itemsize // len(sizes)), len(set(sizes)),
                max(map(sum, sizes)) * itemsize)

    def _fill_weights(
        self, names: list[str], shapes: dict[str, tuple[int, ...]], source: Any,
        blocks: dict[str, Any],
    ) -> dict[str, torch.Tensor]:
        """Lay every dense tensor out in the weights arena (kept blocks as uint8 [rows,
        row_bytes]), fill it and its host copy; the views by name."""
        # q, k, v (and gate, up) back to back, so one arena view can span each group.
        names = fusion_order(names)
        layout = {name: (block_shape(blocks[name], shapes[name]), torch.uint8)
                  if name in blocks else (shapes[name], parameter_dtype(name, self.dtype))
                  for name in names}
        # Blocks of one fusion group lie end to end (whole rows of even bytes), so one view
        # spans them whatever their size; every other tensor starts 256-byte aligned.
        align = {name: 2 if name in blocks and i and names[i - 1] in blocks
                 and same_group(name, names[i - 1]) else TENSOR_ALIGN_BYTES
                 for i, name in enumerate(names)}
        size_bytes = 0
        for name, (shape, dtype) in layout.items():
            size_bytes = round_up(size_bytes, align[name]) + (
                torch.Size(shape).numel() * dtype.itemsize)
        self.weights = self.arenas.add(
            Arena("weights", max(size_bytes, 1), self.backend, WEIGHTS_CHUNK_BYTES)
        )
        self.weights.map()
        views = {name: self.weights.allocate(*layout[name], align[name]) for name in names}
        if not getattr(source, "fills_host", False):
            for name in names:  # made on the device (random weights)
                source.fill(name, views[name])
            # Filled as ordinary memory, pinned once (never per release): see host_copy.py.
            HostCopy.snapshot(self.weights, self.weights.allocated_bytes)
            return views
        # From a file: the host copy is filled from it (blocks as stored, floats cast), pinned
        # once, then copied up in large chunks. No float copy of a kept tensor exists anywhere.
        host = HostCopy(max(self.weights.allocated_bytes, 1), name="host copy of weights")
        for name in names:
            offset = views[name].data_ptr() - self.weights.base_address
            dst = host.tensor(offset, *layout[name])
            if name in blocks:
                source.fill_blocks(name, dst)
            else:
                source.fill(name, dst)
        if self.device.type == "cuda":
            host.pin(self.device.index or 0)
        host.copy_to(self.weights)
        self.weights.attach_host_copy(host)
        return views

    def _expert_slots(
        self, spec: str, config: ModelConfig, num_layers: int, bytes_per_expert: int,
        num_classes: int = 1, staging_bytes: int = 0,
    ) -> int:
        """Slots for the store: every expert for all (and auto when they fit), else N >= E
        for each slot class. A partial cache also maps staging_bytes (one layer's experts
        for prefill: memory/expert_staging.py), which auto leaves room for."""
        total = num_layers * config.num_experts
        budget_free = budget_free_bytes(self.backend)
        if spec == "all" or (spec == "auto" and self.device.type != "cuda" and budget_free is None):
            return total
        free_bytes = 0
        if spec == "auto" and self.device.type == "cuda":
            free_bytes = read_free_vram_bytes(self.device.index or 0)
            if free_bytes is None:
                free_bytes = torch.cuda.mem_get_info(self.device)[0]
        if spec == "auto" and budget_free is not None:  # --vram-budget: what it leaves
            free_bytes = budget_free if self.device.type != "cuda" else min(free_bytes,
                                                                             budget_free)
        # One layer's prefill chunk can route to every expert of that layer at once, and a
        # class's slots take only its layers' experts.
        min_slots = min(total, config.num_experts * num_classes)
        reserve = EXPERT_RESERVE_BYTES
        try:
            slots = size_slots(spec, bytes_per_expert, free_bytes, reserve, total,
                               min_slots=min_slots)
            if spec == "auto" and slots < total:  # partial: the staging comes out of it too
                reserve += staging_bytes
                slots = size_slots(spec, bytes_per_expert, free_bytes, reserve, total,
                                   min_slots=min_slots)
            return slots
        except ValueError as exc:
            if spec != "auto":
                raise  # an explicit size that is too small: the setting is wrong
            # auto found too little free VRAM: another program holds it; a later load can fit.
            missing = min_slots * bytes_per_expert + reserve - free_bytes
            raise EngineOutOfMemory(f"the expert cache does not fit: {exc}",
                                    max(missing, 0)) from exc

    def _resident_expert_views(
        self, by_layer: dict[int, tuple[str, str, str]]
    ) -> dict[str, torch.Tensor]:
        """The stacked [E, ...] parameters of each layer as slices of the store's slots."""
        store, num_experts = self.experts, self.experts.num_experts
        views: dict[str, Any] = {}
        for layer, names in by_layer.items():
            first = store.cache.slot_of(layer, 0)
            slots = [store.cache.slot_of(layer, e) for e in range(num_experts)]
            if first is None or slots != list(range(first, first + num_experts)):
                raise RuntimeError(f"layer {layer}'s experts are not in consecutive slots")
            first = store.local_slot(layer, first)
            stacks = [w[first : first + num_experts] for w in store.slot_weights_of(layer)]
            if store.is_quantized:
                stacks = quantized_experts(store, layer, stacks, self.dtype)
            views.update(zip(names, stacks))
        return views

    # ---- levels -------------------------------------------------------------------------

    def check_resident(self) -> None:
        """Raise EngineError unless everything a forward pass reads is mapped."""
        if self.is_sleeping:
            raise EngineError(ASLEEP)
        if self.experts is not None and self.experts.cache.is_released:
            raise EngineError(EXPERTS_RELEASED)

    def _experts_store(self) -> ExpertStore:
        if self.expert_mode == "none":
            raise LevelNotApplicable("a dense model has no expert cache to release or refill")
        if self.expert_mode == "off":
            raise LevelNotApplicable(
                "the expert cache is off (--expert-cache off): the experts live with the "
                "weights; use sleep to free them"
            )
        return self.experts

    def release_experts(self) -> dict[str, Any]:
        """Unmap the expert cache; returns when the memory is free."""
        store = self._experts_store()
        t0 = time.perf_counter()
        freed = store.release()
        return {"freed_bytes": freed, "release_ms": round((time.perf_counter() - t0) * 1e3, 3)}

    def refill_experts(self) -> dict[str, Any]:
        """Map the expert cache back and restore who was resident; out_of_memory if VRAM is short."""
        store = self._experts_store()
        if self.is_sleeping:
            raise EngineError(f"cannot refill the expert cache: {ASLEEP}")
        if not store.cache.is_released:
            if store.num_slots < store.max_slots:  # shrunk: grow back to every slot
                return self.resize_experts(store.max_slots)
            return {"mapped_bytes": 0, "copied_bytes": 0, "seconds": 0.0}
        needed = self._missing(store.arena)
        if store.staging_arena is not None:
            needed += self._missing(store.staging_arena)
        self.check_free_vram("refilling the expert cache", needed)
        try:
            result = store.refill()
        except ArenaMapError as exc:
            raise _out_of_memory("refilling the expert cache", exc) from exc
        out = {"mapped_bytes": result.mapped_bytes, "copied_bytes": result.copied_bytes,
               "seconds": round(result.seconds, 6),
               "gb_per_s": round(result.copied_bytes / result.seconds / 1e9, 3)
               if result.seconds > 0 else None}
        if result.differing_slots is not None:
            out["differing_slots"] = result.differing_slots
        return out

    @property
    def has_fill_work(self) -> bool:
        """Whether the partial cache has free slots to fill, or a fill chunk on the way
        (ExpertPromotion.fill): work for the engine process's idle moments, which
        Engine.has_deferred_work offers only while the experts are resident."""
        return (self.promotion is not None and not self._fill_failed
                and self.promotion.is_filling)

    def fill_step(self) -> str:
        """One idle step of the free slots' fill; its name, with the experts queued. A step
        that raises ends the idle fill (decode's misses still fill the slots)."""
        try:
            return f"expert fill ({self.promotion.fill_step()} experts queued)"
        except BaseException:
            self._fill_failed = True
            raise

    def would_switch(self, num_slots: int) -> bool:
        """Whether resize_experts(num_slots) switches an all-resident model to the partial
        cache (the fast decoder must then read slots: Engine.resize_experts checks it)."""
        return self.expert_mode == "all" and num_slots < self.experts.max_slots

    def resize_experts(self, num_slots: int) -> dict[str, Any]:
        """Serve from num_slots expert slots (shrink_experts), misses read from the pinned host
        copy. An all-resident model (its experts wired into its layers at load) switches to
        the partial cache first, between two steps (switch_to_slots); it keeps it when
        grown back, every slot resident."""
        store = self._experts_store()
        if self.is_sleeping or store.cache.is_released:
            raise EngineError("the expert cache is not resident: wake or refill it first")
        switch_s = None
        if self.expert_mode == "all":
            if not self.would_switch(num_slots):  # every expert stays where it is
                return {"num_slots": store.num_slots, "max_slots": store.max_slots,
                        "freed_bytes": 0, "mapped_bytes": 0,
                        "resident_bytes": store.arena.resident_bytes, "seconds": 0.0}
            t0 = time.perf_counter()
            self.switch_to_slots()
            switch_s = time.perf_counter() - t0
        if num_slots > store.num_slots:
            needed = (num_slots - store.num_slots) * store.bytes_per_expert
            self.check_free_vram("growing the expert cache", needed)
        t0 = time.perf_counter()
        try:
            result = store.resize(num_slots)
        except ArenaMapError as exc:
            raise _out_of_memory("growing the expert cache", exc) from exc
        result = {**result, "seconds": round(time.perf_counter() - t0, 6)}
        if self.promotion is not None:  # grown: the new slots, empty, start filling
            result["fill_queued_experts"] = self.promotion.fill()
        if switch_s is not None:
            staging = self._map_staging()  # after the shrink freed the slots' memory
            # freed_bytes are the slots' (the experts arena's); the staging's own arena
            # maps staging_bytes of them again.
            result.update(switched_to_slots=True, switch_s=round(switch_s, 6),
                          staging_bytes=staging)
        return result

    @property
    def can_switch_live(self) -> bool:
        """Whether a shrink may switch this all-resident model to the partial cache while it
        serves (switch_to_slots): the GPU reads the store's host copy in place, as the slot
        table's misses need."""
        return (self.expert_mode == "all" and self.experts is not None
                and self.experts.host.device_address is not None)

    def slot_experts(self, layer: int, cpu_misses: CpuMisses | None = None) -> SlotExperts:
        """Layer's partial-cache provider over the store (what switch_to_slots gives it);
        GraphDecoder.warm_expert_cache runs one token through it before any switch (no CPU
        misses: every expert is in its slot then, and the kernels are the same)."""
        return SlotExperts(self.experts, layer, self.dtype, cpu_misses)

    def switch_to_slots(self) -> None:
        """Give each MoE layer of an all-resident model the partial cache's provider
        (SlotExperts: decode reads the slot table, misses in place from the pinned host
        copy; prefill stages or loops), and decode its promotion hook. The store's cache
        already maps every expert to the slot the wired stacks read, so nothing moves: the
        next resize evicts from there. The caller swaps the fast decoder's graphs."""
        self._use_slots(self._moe_layers)
        for mlp in self._moe_layers.values():
            unwire(mlp.experts)
        self.expert_mode = "slots"

    def _use_slots(self, moe_layers: dict[int, Any]) -> None:
        """Give each MoE layer (index -> its SparseMoE) its slot provider and, where the
        GPU reads the host copy in place, decode the promotion of its misses, whose queue
        the CPU misses' prefetch shares (fast/moe_prefetch.py)."""
        cpu_misses = self._cpu_misses()
        for layer, mlp in moe_layers.items():
            mlp.expert_weights = self.slot_experts(layer, cpu_misses)
        if self.experts.host.device_address is not None:
            self.promotion = ExpertPromotion(self.experts)
            if cpu_misses is not None:
                cpu_misses.promotion = self.promotion

    def _map_staging(self) -> int:
        """Map the store's prefill staging (one layer's experts) in an arena of its own when
        the budget and free VRAM allow; else prefill chunks take the loop, which copies their
        misses into slots (fast/moe_grouped.py). The bytes mapped."""
        store = self.experts
        needed = store.staging_bytes_needed()
        try:
            self.check_free_vram("the prefill's expert staging", needed)
            mapped = store.add_staging()
        except (EngineOutOfMemory, ArenaMapError) as exc:
            log.info("no prefill staging for the shrunk expert cache (%s): prefill chunks "
                     "copy their missing experts into slots", exc)
            return 0
        self.arenas.add(store.staging_arena)
        return mapped

    def release_for_sleep(self) -> int:
        """Unmap weights and experts (the caller releases KV first); returns bytes freed."""
        freed = self.weights.release()
        if self.experts is not None:
            freed += self.experts.release()
        self.is_sleeping = True
        return freed

    def wake(self) -> dict[str, Any]:
        """Map and copy back the weights, then the experts, at the same addresses; all or none."""
        if not self.is_sleeping:
            return {"mapped_bytes": 0, "copied_bytes": 0, "seconds": 0.0}
        needed = self._missing(self.weights)
        if self.experts is not None:
            needed += self._missing(self.experts.arena)
            if self.experts.staging_arena is not None:
                needed += self._missing(self.experts.staging_arena)
        self.check_free_vram("waking the model", needed)
        t0 = time.perf_counter()
        try:
            weights = self.weights.refill()
        except ArenaMapError as exc:
            raise _out_of_memory("waking the model", exc) from exc
        mapped, copied = weights.mapped_bytes, weights.copied_bytes
        if self.experts is not None and self.experts.arena.state != "mapped":
            try:
                experts = self.experts.refill()
            except ArenaMapError as exc:
                self.weights.release()  # stay asleep as a whole: the next wake can succeed
                raise _out_of_memory("waking the model", exc) from exc
            mapped, copied = mapped + experts.mapped_bytes, copied + experts.copied_bytes
        self.is_sleeping = False
        seconds = time.perf_counter() - t0
        return {"mapped_bytes": mapped, "copied_bytes": copied, "seconds": round(seconds, 6),
                "gb_per_s": round(copied / seconds / 1e9, 3) if seconds > 0 else None}

    def _missing(self, arena: Arena) -> int:
        return arena.reserved_bytes - arena.resident_bytes

    def check_free_vram(self, what: str, needed_bytes: int) -> None:
        """Refuse before mapping anything when NVML says the GPU lacks needed_bytes, or the
        --vram-budget does not leave them."""
        budget_free = budget_free_bytes(self.backend)
        if budget_free is not None and 0 < budget_free < needed_bytes:
            raise EngineOutOfMemory(
                f"{what} needs {needed_bytes / MIB:.0f} MiB but the VRAM budget leaves "
                f"{budget_free / MIB:.0f} MiB: raise --vram-budget or release something first",
                needed_bytes - budget_free,
            )
        if self.device.type != "cuda" or needed_bytes <= 0:
            return
        free_bytes = read_free_vram_bytes(self.device.index or 0)
        if free_bytes is not None and free_bytes < needed_bytes:
            missing = needed_bytes - free_bytes
            raise EngineOutOfMemory(
                f"{what} needs {needed_bytes / MIB:.0f} MiB of VRAM but {free_bytes / MIB:.0f} "
                f"MiB are free: {missing / MIB:.0f} MiB missing; free VRAM and retry",
                missing,
            )

    def status(self) -> dict[str, Any] | None:
        """The expert cache's counters and mode, or None without one (dense, or off)."""
        if self.experts is None:
            return None
        return {"mode": self.expert_mode, **self.experts.status()}

    def close(self) -> None:
        """Free every arena and host copy (unload): VRAM first, since unpinning the host
        copies takes longer (0.7 s for 16 GiB on an H200) and only RAM waits for it."""
        self.cpu_miss_setting.close()  # its workers read the host copy
        self.arenas.close()
        if self.weights is not None and self.weights.host_copy is not None:
            self.weights.host_copy.close()
        if self.experts is not None:
            self.experts.host.close()
        self.weights = self.experts = self.promotion = None
        self._moe_layers = {}


def _quantized(qtype: Any, shape: tuple[int, ...], raw: torch.Tensor,
               dtype: torch.dtype) -> QuantizedWeight | QuantizedExperts:
    """A kept tensor's blocks as the quantized type its readers take: stacked experts [E, N, K]
    or a matrix [N, K]."""
    if len(shape) == 3:
        return QuantizedExperts(qtype, shape, raw, dtype)  # type: ignore[arg-type]
    return QuantizedWeight(qtype, shape, raw, dtype)  # type: ignore[arg-type]


def _out_of_memory(what: str, exc: ArenaMapError) -> EngineOutOfMemory:
    return EngineOutOfMemory(
        f"{what} failed: {exc.missing_bytes / MIB:.0f} MiB of VRAM missing for the "
        f"{exc.arena_name} arena; free VRAM and retry (nothing was lost)",
        exc.missing_bytes,
    )

