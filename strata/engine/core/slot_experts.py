"""The expert provider of a partial expert cache: one MoE layer's view of the ExpertStore's
slots (decode through the slot table, the loop's misses copied in) and of the prefill's
staging (memory/expert_staging.py). Split from residency.py, which builds it per layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.models.switch import SlotLayout
from strata.engine.core.quant.experts import ExpertMatrices, QuantizedExperts


class SlotExperts:
    """ExpertWeights provider over an N-slot ExpertStore: slot views, misses copied in; for
    one-token decode also the slot table layout (None where the GPU cannot read the host
    copy in place: then decode takes the loop through `get`)."""

    def __init__(self, store: ExpertStore, layer: int, dtype: torch.dtype, cpu_misses=None):
        """cpu_misses: the store's CpuMisses (fast/moe_cpu_misses.py) when one token's misses
        are computed on the CPU; None: read in place."""
        self.store = store
        self.layer = layer
        self.dtype = dtype
        self._staged: tuple | None = None  # the staging as this layer's stacks (made once)
        # The MoE layer after this one, whose experts a prefill chunk stages while this one
        # computes; not the model's last layer, whose MLP a chunk before the last skips.
        later = [i for i in store.layer_ids if i > layer]
        self.next_layer = later[0] if later and later[0] < store.table.shape[0] - 1 else None
        # Quantized: the slots as this layer's QuantizedExperts (its types and row bytes).
        slots = store.slot_weights_of(layer)
        self.quantized = (quantized_experts(store, layer, slots, dtype)
                          if store.is_quantized else None)
        offsets = store.host_offsets(layer)
        weights = self.quantized or slots
        self.layout = None if offsets is None else SlotLayout(
            *weights, store.table[layer], offsets, store.step_ids[layer],
            cpu_misses.for_layer(layer) if cpu_misses is not None else None,
        )

    @property
    def can_stage(self) -> bool:
        """Whether prefill chunks stage this layer's experts whole (a partial cache has the
        staging area; see memory/expert_staging.py)."""
        return self.store.staging is not None

    def staged(self, experts: Sequence[int] | None = None) -> tuple:
        """(gate, up, down) of every expert of this layer, stacked [E, ...] as the grouped
        prefill reads resident experts, from the staging area; `experts` (None: all) hold
        their weights, the others stale bytes. Nothing enters the cache."""
        self.store.staging.stage(self.layer, experts)
        return self.staging_stacks()

    def staging_stacks(self) -> tuple:
        """The staging as this layer's (gate, up, down) stacks, whatever they hold now
        (`staged` fills them): QuantizedExperts for blocks."""
        if self._staged is None:
            stacks = self.store.staging.views(self.layer)
            self._staged = (quantized_experts(self.store, self.layer, stacks, self.dtype)
                            if self.quantized is not None else stacks)
        return self._staged

    def prefetch_next(self) -> None:
        """Stage the next MoE layer's experts behind the work queued so far (a long chunk,
        which routes to nearly all of them); its `staged` call waits for them."""
        if self.next_layer is not None:
            self.store.staging.stage(self.next_layer, None, wait=False)

    def get(self, expert_ids: Sequence[int]):
        slots = self.store.fetch_slots(self.layer, expert_ids)
        if self.quantized is not None:  # dequantized one at a time, on use
            return tuple(ExpertMatrices(w, slots) for w in self.quantized)
        gate, up, down = self.store.slot_weights_of(self.layer)
        return [gate[s] for s in slots], [up[s] for s in slots], [down[s] for s in slots]


def quantized_experts(store: ExpertStore, layer: int, weights: Sequence[torch.Tensor],
                      dtype: torch.dtype) -> tuple[QuantizedExperts, ...]:
    """A quantized store's [n, stride] rows (slots) as layer's gate, up, down QuantizedExperts."""
    return tuple(QuantizedExperts(fmt.qtype, (w.shape[0], *fmt.shape), w, dtype)
                 for w, fmt in zip(store.blocks(layer, weights), store.formats[layer]))
