"""The slot table an expert kernel is passed (kernels/launch.py slot_table_arg): without a
table, a stand-in of the table's dtype over the ids' memory. Triton's autotuner keys a pick
by every tensor argument's dtype; with the int64 ids standing in, the stacked kernels were
tuned apart from the slot-table ones, picked other tiles in some runs, and a partial cache's
tokens parted from all-resident at a bf16 near tie (run 41; the GPU side:
tests/gpu/test_slot_table_tuning_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.kernels.launch import slot_table_arg


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_without_a_table_the_stand_in_is_int32_over_the_ids(dtype) -> None:
    ids = torch.tensor([5, 1, 6, 2], dtype=dtype)
    stand_in = slot_table_arg(None, ids)
    assert stand_in.dtype == torch.int32  # the slot table's, so one autotune key for both
    assert stand_in.data_ptr() == ids.data_ptr()  # no copy: free inside a CUDA graph


def test_a_table_is_passed_as_it_is() -> None:
    table = torch.tensor([3, -1, 0, 1], dtype=torch.int32)
    assert slot_table_arg(table, torch.tensor([0, 2])) is table


def test_non_contiguous_ids_are_made_contiguous_first() -> None:
    ids = torch.arange(8)[::2]
    stand_in = slot_table_arg(None, ids)
    assert stand_in.dtype == torch.int32 and stand_in.is_contiguous()
    assert stand_in.view(torch.int64).tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("table", [torch.zeros(4, dtype=torch.int64),
                                   torch.zeros(4, 2, dtype=torch.int32),
                                   torch.zeros(8, dtype=torch.int32)[::2]],
                         ids=["int64", "2-D", "strided"])
def test_a_table_every_kernel_would_misread_is_refused(table) -> None:
    with pytest.raises(ValueError, match="contiguous int32 \\[E\\]"):
        slot_table_arg(table, torch.tensor([0, 2]))
