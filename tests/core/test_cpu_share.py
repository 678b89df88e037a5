"""A MoE layer's balanced CPU share of its misses (fast/cpu_share.py): how many misses it
gives the CPU, how one observation moves it, its bounds, and the probe off CUDA."""

from __future__ import annotations

import os

import pytest
import torch

# strata.engine.core.fast decorates Triton kernels on import: the interpreter must be chosen
# first, as in every test module that imports it (tests/core/test_fast_paths.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine.core.fast.cpu_share import FLOOR, STEP, GpuProbe, ShareBalance


def test_the_count_rounds_up_so_a_layer_with_a_miss_gives_the_cpu_one() -> None:
    balance = ShareBalance(0.5)
    assert [balance.count(m) for m in range(5)] == [0, 1, 1, 2, 2]
    assert ShareBalance(FLOOR).count(4) == 1 and ShareBalance(1.0).count(4) == 4


def test_a_busy_gpu_raises_the_share_an_idle_one_lowers_it_within_bounds() -> None:
    balance = ShareBalance(0.5)
    balance.observe(True)
    assert balance.share == pytest.approx(0.5 + STEP)
    balance.observe(False)
    balance.observe(False)
    assert balance.share == pytest.approx(0.5 - STEP) and balance.num_observed == 3
    for _ in range(100):
        balance.observe(False)
    assert balance.share == FLOOR
    for _ in range(100):
        balance.observe(True)
    assert balance.share == 1.0


def test_it_settles_where_the_sides_finish_together() -> None:
    """A layer of 4 misses, the CPU twice as fast an expert as the link: the CPU should
    take about two thirds. Each token the slower side is the one the share moves from."""
    cpu_us, link_us, missed = 1.0, 2.0, 4
    balance = ShareBalance(0.5)
    counts = []
    for _ in range(200):
        on_cpu = balance.count(missed)
        counts.append(on_cpu)
        balance.observe(gpu_busy=(missed - on_cpu) * link_us > on_cpu * cpu_us)
    assert set(counts[-20:]) <= {2, 3}  # 8/3 of 4: dithers between the two nearest


@pytest.mark.parametrize("share", [0.0, FLOOR / 2, 1.5, float("nan")])
def test_a_share_out_of_bounds_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="CPU share"):
        ShareBalance(share)


def test_off_cuda_the_device_has_always_finished() -> None:
    probe = GpuProbe(torch.device("cpu"))
    probe.mark()
    assert not probe.busy()
