"""The vocabulary's argmax in one launch (fast/argmax.py), through Triton's CPU interpreter:
torch.argmax's index on ties, -inf, NaN and rows that end inside a program, the counter back
at 0 after every launch, and a clear refusal of what it does not take.
tests/gpu/test_sampling_cuda.py runs it compiled, from a CUDA graph, with PDL.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import argmax


def _row(num_values: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(num_values, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check(x: torch.Tensor) -> None:
    counter = argmax.new_counter(x.device)
    got = argmax.first_max(x, counter)
    assert got.dtype == torch.int64 and got.shape == (1,)
    assert got.item() == torch.argmax(x, dim=-1).item()
    assert counter.item() == 0  # ready for the next launch, as a graph replay needs


# One program, a row ending inside the second program, and three whole programs.
@pytest.mark.parametrize("num_values", [1, 1000, argmax.BLOCK + 17, 3 * argmax.BLOCK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_is_torch_argmax(num_values: int, dtype: torch.dtype) -> None:
    _check(_row(num_values, seed=num_values, dtype=dtype))


def test_ties_go_to_the_lowest_index_across_programs() -> None:
    x = _row(3 * argmax.BLOCK, seed=1)
    x[[5000, argmax.BLOCK + 3, 2 * argmax.BLOCK + 9]] = 10.0  # ties in programs 1 and 2 ...
    _check(x)
    x[4500] = 10.0  # ... and one earlier in program 1
    _check(x)


def test_all_minus_inf_gives_zero_and_nan_wins() -> None:
    x = torch.full((argmax.BLOCK + 5,), float("-inf"))
    _check(x)
    x[argmax.BLOCK + 2] = float("nan")
    _check(x)


def test_bad_input_is_refused_with_one_line() -> None:
    counter = argmax.new_counter(torch.device("cpu"))
    for bad in (torch.zeros(2, 8), torch.zeros(0), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="one non-empty row of floats"):
            argmax.first_max(bad, counter)
    with pytest.raises(ValueError, match="counter"):
        argmax.first_max(torch.zeros(8), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="up to"):
        argmax.first_max(torch.zeros(argmax.MAX_PROGRAMS * argmax.BLOCK + 1), counter)
    assert counter.item() == 0
