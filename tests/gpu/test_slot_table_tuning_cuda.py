"""The slot-table expert kernels take the stacked ones' autotuned tiles, so a partial cache
sums each expert in the order all-resident does and decodes bit for bit like it.

Run 41: Triton's autotuner keys a pick by every tensor argument's dtype, and the stacked
launches passed the int64 ids where the slot-table ones pass the int32 table; each variant
was timed apart, picked other tiles in some runs, and the live shrink's tokens parted from
the unshrunk stream's at a bf16 near tie (tests/gpu/test_live_shrink_cuda.py failed in about
a third of its runs, the 30B shrink row too). The CPU side: tests/core/test_slot_table_arg.py.
Run: python -m pytest -q tests/gpu/test_slot_table_tuning_cuda.py"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.gpu.test_quant_expert_gemv_cuda import _experts, _stack

pytestmark = pytest.mark.gpu

# Shapes no other test tunes, so each kernel's first pick here is made by these calls.
NUM_EXPERTS, HIDDEN, INTER = 8, 1088, 320


def _keys_added(tuners, call) -> tuple[set, torch.Tensor]:
    """(the (tuner, key) picks `call` added to any of tuners' caches, its result)."""
    def picks() -> set:
        return {(id(tuned), key) for tuned in tuners for key in tuned.cache}
    before = picks()
    out = call()
    torch.cuda.synchronize()
    return picks() - before, out


def _table_and_ids(num_experts: int):
    table = torch.arange(num_experts, dtype=torch.int32, device="cuda")  # all in their slots
    return table, torch.tensor([5, 1, 6, 2], device="cuda")  # int64, as the router's


def test_bf16_grouped_kernels_tune_once_for_stacked_and_slot_table() -> None:
    from strata.engine.core.fast import moe_triton

    gen = torch.Generator().manual_seed(0)
    gate, up = ((torch.randn(NUM_EXPERTS, INTER, HIDDEN, generator=gen) * 0.05)
                .to("cuda", torch.bfloat16) for _ in range(2))
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) * 0.05).to("cuda",
                                                                             torch.bfloat16)
    x = torch.randn(HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    table, ids = _table_and_ids(NUM_EXPERTS)
    weights = torch.full((4,), 0.25, dtype=torch.bfloat16, device="cuda")

    stacked_keys, act = _keys_added([moe_triton._gate_up_tuned],
                                    lambda: moe_triton.grouped_gate_up(x, gate, up, ids))
    table_keys, act_table = _keys_added(
        [moe_triton._gate_up_tuned],
        lambda: moe_triton.grouped_gate_up(x, gate, up, ids, table, (0, 0)))
    assert len(stacked_keys) == 1 and table_keys == set()  # the stacked pick, reused
    assert torch.equal(act, act_table)

    stacked_keys, out = _keys_added([moe_triton._down_sum_tuned],
                                    lambda: moe_triton.grouped_down_sum(act, down, ids, weights))
    table_keys, out_table = _keys_added(
        [moe_triton._down_sum_tuned],
        lambda: moe_triton.grouped_down_sum(act, down, ids, weights, table, 0))
    assert len(stacked_keys) == 1 and table_keys == set()
    assert torch.equal(out, out_table)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_quantized_expert_gemvs_tune_once_for_stacked_and_slot_table(qtype: QT) -> None:
    from strata.engine.core.quant import expert_gemv

    inter = 512  # a width no other test tunes (Q4_K/Q6_K blocks: a multiple of 256)
    shapes = ((inter, 2048), (inter, 2048), (2048, inter))
    stacks = [_stack(qtype, rows, cols, seed=int(qtype) + p)
              for p, (rows, cols) in enumerate(shapes)]
    gate, up, down = (_experts(qtype, b.cuda(), *s) for (b, _), s in zip(stacks, shapes))
    gen = torch.Generator().manual_seed(int(qtype))
    x = (torch.randn(2048, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    table, ids = _table_and_ids(gate.shape[0])
    weights = torch.full((4,), 0.25, dtype=torch.bfloat16, device="cuda")
    tuners = [expert_gemv._gate_up_tuned, expert_gemv._down_sum_tuned,
              expert_gemv._gate_up_dp4a_tuned, expert_gemv._down_sum_dp4a_tuned]

    stacked_keys, act = _keys_added(tuners, lambda: expert_gemv.gate_up(x, gate, up, ids))
    table_keys, act_table = _keys_added(
        tuners, lambda: expert_gemv.gate_up(x, gate, up, ids, table, (0, 0)))
    assert len(stacked_keys) == 1 and table_keys == set()
    assert torch.equal(act, act_table)
    stacked_keys, out = _keys_added(tuners,
                                    lambda: expert_gemv.down_sum(act, down, ids, weights))
    table_keys, out_table = _keys_added(
        tuners, lambda: expert_gemv.down_sum(act, down, ids, weights, table, 0))
    assert len(stacked_keys) == 1 and table_keys == set()
    assert torch.equal(out, out_table)
