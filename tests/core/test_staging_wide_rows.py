"""expert_staging.wide_rows: the gather's views move the same bytes as the weights', wider."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.memory.expert_staging import wide_rows


@pytest.mark.parametrize(("dtype", "shape", "wide"), [
    (torch.uint8, (6, 4, 144), torch.int64),  # Q4_K blocks: 144 bytes a block
    (torch.uint8, (6, 3, 66), torch.int16),  # IQ2_XXS-like rows of 66 bytes: 198 a row
    (torch.uint8, (6, 5, 17), torch.uint8),  # odd bytes a row: left as bytes
    (torch.bfloat16, (6, 8, 16), torch.int64),
    (torch.bfloat16, (6, 3, 2), torch.int32),  # 12 bytes a row
])
def test_wide_rows_alias_the_weights_and_gather_the_same_bytes(dtype, shape, wide) -> None:
    weights = torch.randint(0, 255, shape, dtype=torch.uint8).view(dtype) if dtype == \
        torch.uint8 else torch.randn(shape).to(dtype)
    (rows,) = wide_rows(weights)
    assert rows.dtype == wide and rows.shape[0] == shape[0]
    assert rows.data_ptr() == weights.data_ptr()  # a view: writes reach the weights
    # A gather over the wide rows equals one over the weights, byte for byte.
    src, dst = weights.clone(), torch.zeros_like(weights)
    src_index, dst_index = torch.tensor([4, 1, 5]), torch.tensor([0, 2, 3])
    wide_dst, wide_src = wide_rows(dst, src)
    wide_dst.index_copy_(0, dst_index, wide_src.index_select(0, src_index))
    expect = torch.zeros_like(weights)
    expect.index_copy_(0, dst_index, src.index_select(0, src_index))
    assert torch.equal(dst.view(torch.uint8), expect.view(torch.uint8))


def test_wide_rows_follow_the_address_and_stride_and_agree_on_one_type() -> None:
    flat = torch.zeros(8 * 48 + 2, dtype=torch.uint8)
    shifted = flat[2:].view(8, 48)  # 48 bytes a row, but the address is 2 mod 8
    assert wide_rows(shifted)[0].dtype == torch.int16
    aligned = torch.zeros(8, 48, dtype=torch.uint8)
    # Both take the type the less aligned allows: index_copy_ needs its source's dtype.
    assert [r.dtype for r in wide_rows(aligned, shifted)] == [torch.int16, torch.int16]
    assert wide_rows(aligned)[0].dtype == torch.int64
    strided = torch.arange(48, dtype=torch.uint8).view(8, 6)[:, ::2]  # rows not dense
    (rows,) = wide_rows(strided)
    assert rows.dtype == torch.uint8 and torch.equal(rows, strided)  # bytes, same view
