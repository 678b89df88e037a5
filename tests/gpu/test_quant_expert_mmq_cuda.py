"""The int8 tensor-core grouped GEMMs over Q4_K, Q6_K and Q8_0 experts (quant/expert_mmq.py)
compiled on the GPU: a 512-token chunk at Qwen3-30B-A3B's expert shape against float32
torch on gguf-py's dequantized experts times the int8-rounded rows; every tile candidate;
a CUDA graph replayed with new routing; close to the bf16 path (expert_gemm.py).

The CPU twin: tests/core/test_quant_expert_mmq.py (interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from tests.gpu.test_quant_expert_gemm_cuda import NUM_EXPERTS, Q4_K_M, _assert_close, _layer, _routed

pytestmark = pytest.mark.gpu

# Exact integer products, float32 scale sums in another order, bf16 act and output: within
# this fraction of the output's scale of the float64-like reference.
REL_TOL = 1e-2
REFERENCE_EXPERTS = 32  # Qwen3-30B-A3B's expert shape, fewer experts: gguf-py dequantizes them


def _int8_rounded(x: torch.Tensor) -> torch.Tensor:
    from strata.engine.core.quant import gemv_dp4a

    q, d, _, _ = gemv_dp4a.quantize_x(x.contiguous())
    return (q.float().view(x.shape[0], -1, 32) * d[:, :, None]).view(x.shape)


def _reference(rows, offsets, row_weights, dense, act) -> tuple[torch.Tensor, torch.Tensor]:
    """(act, y) in float32 per expert from int8-rounded rows (y from the kernel's act)."""
    gate, up, down = dense
    x_all, a_all = _int8_rounded(rows), _int8_rounded(act)
    acts = torch.empty(act.shape, dtype=torch.float32, device="cuda")
    ys = torch.empty(rows.shape, dtype=torch.float32, device="cuda")
    begin = 0
    for expert, end in enumerate(offsets.tolist()):
        x = x_all[begin:end]
        acts[begin:end] = (F.silu(x @ gate[expert].T) * (x @ up[expert].T)
                           * row_weights[begin:end, None].float())
        ys[begin:end] = a_all[begin:end] @ down[expert].T
        begin = end
    return acts, ys


@pytest.mark.parametrize("types", [Q4_K_M, (QT.Q8_0,) * 3, (QT.Q6_K, QT.Q4_K, QT.Q8_0)],
                         ids=["Q4_K_M", "Q8_0", "mixed"])
def test_cuda_int8_chunk_at_qwen3_30b_a3b_expert_shape_matches_torch(types) -> None:
    from strata.engine.core.quant import expert_gemm, expert_mmq

    blocks, dense = _layer(types, num_experts=REFERENCE_EXPERTS, with_reference=True)
    assert expert_mmq.supports(*blocks)
    rows, offsets, row_weights = _routed(REFERENCE_EXPERTS)
    act = expert_mmq.gate_up(rows, offsets, blocks[0], blocks[1], row_weights)
    y = expert_mmq.down(act, offsets, blocks[2])
    act_expected, y_expected = _reference(rows, offsets, row_weights, dense, act)
    _assert_close(act, act_expected, REL_TOL)
    _assert_close(y, y_expected, REL_TOL)
    # And what the int8 rounding of x moves against the bf16 path: a few percent at most.
    _assert_close(expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights),
                  expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights), 5e-2)


def test_every_int8_candidate_tile_computes_the_same(monkeypatch) -> None:
    import triton

    from strata.engine.core.quant import expert_mmq

    blocks, _ = _layer(Q4_K_M, num_experts=16)
    rows, offsets, row_weights = _routed(16, tokens=256)
    expected = None
    for tuned, configs in ((expert_mmq._gate_up_tuned, expert_mmq.GATE_UP_CONFIGS),
                           (expert_mmq._down_tuned, expert_mmq.DOWN_CONFIGS)):
        for rows_n, cols, warps, extra in expert_mmq._candidates(configs):
            monkeypatch.setattr(tuned, "configs", [triton.Config(
                {"BLOCK_ROWS": rows_n, "BLOCK_COLS": cols, **extra}, num_warps=warps)])
            got = expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights)
            if expected is None:
                expected = got
            _assert_close(got, expected, 1e-2)


def test_cuda_int8_graph_replays_with_new_routing() -> None:
    from strata.engine.core.quant import expert_mmq

    blocks, _ = _layer(Q4_K_M)
    rows, offsets, row_weights = _routed(NUM_EXPERTS, tokens=128, seed=1)
    expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights)  # compile outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights)
    for seed in (2, 3):
        new_rows, new_offsets, new_weights = _routed(NUM_EXPERTS, tokens=128, seed=seed)
        rows.copy_(new_rows)
        offsets.copy_(new_offsets)
        row_weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        expected = expert_mmq.experts_mlp(rows, *blocks, offsets, row_weights)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
