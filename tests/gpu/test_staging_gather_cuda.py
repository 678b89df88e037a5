"""The staging's gather over wide rows (memory/expert_staging.gather) lands the bytes a
direct index would, on a slot tensor past 2**31 bytes: as uint8 that size took index_select's
64-bit index math, as int64 rows it does not, and a view that moved the wrong bytes would
show here. Run: python -m pytest -q tests/gpu/test_staging_gather_cuda.py"""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.memory.expert_staging import gather, wide_rows

pytestmark = pytest.mark.gpu

SLOTS, PROJ_BYTES = 5600, 393216  # 2.2 GB of IQ2_XXS-sized projections: past 2**31 bytes


def test_wide_rows_gather_equals_a_direct_index_past_2_31_bytes() -> None:
    device = torch.device("cuda")
    slots = torch.empty(SLOTS, PROJ_BYTES, dtype=torch.uint8, device=device).random_(0, 256)
    assert slots.numel() > 2**31
    staging = torch.zeros(128, PROJ_BYTES, dtype=torch.uint8, device=device)
    generator = torch.Generator().manual_seed(0)
    source = torch.randperm(SLOTS, generator=generator)[:128]
    source[0] = SLOTS - 1  # the last slot: its bytes lie past 2**31
    experts = torch.randperm(128, generator=generator)
    wide_src = wide_rows(staging, slots)[1]
    assert wide_src.dtype == torch.int64 and wide_src.data_ptr() == slots.data_ptr()
    slot_of = dict(zip(experts.tolist(), source.tolist()))
    gather([staging], [slots], experts.tolist(), slot_of)
    expect = torch.empty_like(staging)
    expect[experts.to(device)] = slots[source.to(device)]
    assert torch.equal(staging, expect)
