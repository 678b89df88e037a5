"""How the ExpertStore lays experts out: a quantized projection's block format, the slot
classes (layers whose experts have one size, with their own slots), the views of slot rows
as blocks, and the runs copies are batched into. Split from expert_store.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BlockFormat:
    """How one layer's projection is stored when quantized: GGML type, logical [N, K] of one
    expert, and the bytes of one of its rows of blocks."""

    qtype: Any
    shape: tuple[int, int]
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes


@dataclass
class SlotClass:
    """Layers whose experts have one size, and their slots in the arena: per projection an
    [n, ...] tensor (float: the expert's shape; blocks: its bytes), n = max_slots."""

    layers: list[int]
    shapes: tuple[tuple[int, ...], ...]  # gate, up, down of one slot
    proj_bytes: tuple[int, ...]
    max_slots: int  # the cache's pool of these layers (its slot numbers start at cache.bases)
    weights: tuple[torch.Tensor, ...] = ()

    @property
    def bytes_per_expert(self) -> int:
        return sum(self.proj_bytes)


def contiguous_runs(
    assignments: Sequence[tuple[int, int, int]],
) -> list[tuple[int, int, int, int]]:
    """(layer, first expert, first slot, count) for (layer, expert, slot) assignments: runs of
    consecutive experts of one layer in consecutive slots, in (layer, expert) order."""
    runs: list[tuple[int, int, int, int]] = []
    for layer, expert, slot in sorted(assignments):
        if runs:
            last_layer, first_expert, first_slot, count = runs[-1]
            if (layer == last_layer and expert == first_expert + count
                    and slot == first_slot + count):
                runs[-1] = (last_layer, first_expert, first_slot, count + 1)
                continue
        runs.append((layer, expert, slot, 1))
    return runs


def as_blocks(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """uint8 [n, stride] as [n, N, row_bytes] blocks of fmt (a view; padding left out)."""
    return rows.as_strided((rows.shape[0], fmt.shape[0], fmt.row_bytes),
                           (rows.stride(0), fmt.row_bytes, 1))
