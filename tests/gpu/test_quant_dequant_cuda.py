"""The dequantizer (quant/dequant.py) and the MoE prefill's two quantized paths compiled on
the GPU: bit for bit against gguf-py at Llama-3-8B's and Qwen3-30B-A3B's shapes, per type,
for every tile candidate the autotuner may pick; expert_gemm and the grouped path
(quant/expert_grouped.py, 32 experts a group) against torch on the dequantized experts at
Qwen3-30B-A3B's shape, through moe_prefill's per-call choice; a CUDA graph of the grouped
path replayed with new routing; and the load's scratch reservation (no growth in prefill).

The CPU twins: tests/core/test_quant_dequant.py, test_quant_expert_grouped.py.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.gpu.gpu_helpers import captured
from tests.helpers.moe_stub import moe_stub
from tests.helpers.quant_blocks import random_blocks

pytestmark = pytest.mark.gpu

PLANES_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
                QT.Q2_K, QT.IQ2_XXS, QT.MXFP4]
TILE_TYPES = [QT.Q3_K, QT.IQ4_XS, QT.IQ3_S]
NUM_EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
Q4_K_M = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
# bf16 products summed in another order (and, for expert_gemm, weights rounded in registers):
# within this fraction of the output's scale, as in test_quant_expert_gemm_cuda.py.
REL_TOL = 2e-2


def _blocks(qtype: QT, rows: int, cols: int, seed: int):
    """(uint8 blocks on CUDA [rows, row_bytes], gguf-py's float32 values [rows, cols])."""
    raw = random_blocks(qtype, rows, cols, seed)
    return torch.from_numpy(raw).cuda(), gguf.quants.dequantize(raw, qtype)


def _assert_exact(got: torch.Tensor, expected: np.ndarray) -> None:
    if got.dtype == torch.float32:
        np.testing.assert_array_equal(got.cpu().numpy(), expected)
    else:
        assert torch.equal(got.cpu(), torch.from_numpy(expected).to(got.dtype))


@pytest.fixture
def first_candidate(monkeypatch):
    """The dequantizer tuned over its first tile only (every candidate compiles once per
    type and output dtype; test_cuda_every_candidate_tile_equals_gguf_py runs them all)."""
    from strata.engine.core.quant import dequant

    for tuned in dequant._tuned.values():
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])


@pytest.mark.parametrize("qtype", PLANES_TYPES + TILE_TYPES, ids=lambda t: t.name)
def test_cuda_dequantize_equals_gguf_py_at_real_shapes(qtype: QT, first_candidate) -> None:
    """Llama-3-8B's qkv [6144, 4096] and down's K of 14336 (1000 rows: a partial row tile),
    then 16 of Qwen3-30B-A3B's down experts [2048, 768] (K = 768: a partial column tile for
    the wide candidates) padded 64 bytes apart; float32 bit for bit, and bf16 after rounding.
    Through the tuned launcher (first tile only)."""
    from strata.engine.core.quant import dequant
    from strata.engine.core.quant.experts import QuantizedExperts

    expected_kernel = "planes" if qtype in PLANES_TYPES else "tile"
    for rows, cols in ((6144, 4096), (1000, 14336)):
        blocks, expected = _blocks(qtype, rows, cols, seed=int(qtype) + rows)
        assert dequant.kernel_for(qtype, blocks) == expected_kernel
        for dtype in (torch.float32, torch.bfloat16):
            _assert_exact(dequant.dequantize(blocks, qtype, cols, dtype), expected)
    count = 16
    blocks, expected = _blocks(qtype, count * HIDDEN, INTER, seed=int(qtype))
    row_bytes = blocks.shape[1]
    padded = torch.zeros(count, HIDDEN * row_bytes + 64, dtype=torch.uint8, device="cuda")
    padded[:, : HIDDEN * row_bytes] = blocks.view(count, -1)
    view = padded.as_strided((count, HIDDEN, row_bytes), (padded.stride(0), row_bytes, 1))
    experts = QuantizedExperts(qtype, (count, HIDDEN, INTER), view, torch.bfloat16)
    out = torch.empty(count, HIDDEN, INTER, dtype=torch.bfloat16, device="cuda")
    _assert_exact(dequant.dequantize_experts(experts, 0, out),
                  expected.reshape(count, HIDDEN, INTER))


@pytest.mark.parametrize("qtype", PLANES_TYPES + TILE_TYPES[:1], ids=lambda t: t.name)
def test_cuda_every_candidate_tile_equals_gguf_py(qtype: QT) -> None:
    """Each tile the autotuner may choose, compiled and run on its own, on a matrix that
    leaves partial row and column tiles (1000 x 768 and 100 x 4096)."""
    from strata.engine.core.quant import dequant

    kernel = "planes" if qtype in PLANES_TYPES else "tile"
    configs = dequant.PLANES_CONFIGS if kernel == "planes" else dequant.TILE_CONFIGS
    for rows, cols in ((1000, 768), (100, 4096)):
        blocks, expected = _blocks(qtype, rows, cols, seed=rows)
        for config in configs:
            got = dequant.dequantize(blocks, qtype, cols, torch.bfloat16,
                                     fixed=(kernel, config))
            _assert_exact(got, expected)


def test_cuda_embedding_rows_tune_once_for_any_count() -> None:
    """Gathered rows key the autotuner by shape alone: a new row count (a prompt of another
    length inside a CUDA graph) finds its tile chosen already."""
    from strata.engine.core.quant import dequant

    blocks, expected = _blocks(QT.Q6_K, 512, 4096, seed=1)
    dequant.dequantize(blocks[:1], QT.Q6_K, 4096, torch.bfloat16, gathered=True)
    tuned = dequant._tuned["planes"]
    cached = len(tuned.cache)
    for count in (7, 200, 512):
        got = dequant.dequantize(blocks[:count].contiguous(), QT.Q6_K, 4096, torch.bfloat16,
                                 gathered=True)
        _assert_exact(got, expected[:count])
    assert len(tuned.cache) == cached


# ---- MoE prefill ----------------------------------------------------------------------


def _layer(types=Q4_K_M, with_reference: bool = False):
    """((gate, up, down) QuantizedExperts at Qwen3-30B-A3B's shape in bf16, the float32
    references or Nones)."""
    from strata.engine.core.quant.experts import QuantizedExperts

    made = []
    for p, (qtype, (rows, cols)) in enumerate(zip(types, ((INTER, HIDDEN), (INTER, HIDDEN),
                                                          (HIDDEN, INTER)))):
        raw = random_blocks(qtype, NUM_EXPERTS * rows, cols, seed=p, scale=0.02)
        reference = None
        if with_reference:
            reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(
                NUM_EXPERTS, rows, cols).cuda()
        blocks = torch.from_numpy(raw).view(NUM_EXPERTS, rows, -1).cuda()
        made.append((QuantizedExperts(qtype, (NUM_EXPERTS, rows, cols), blocks,
                                      torch.bfloat16), reference))
    return tuple(m[0] for m in made), tuple(m[1] for m in made)


def _routing(tokens: int, seed: int):
    """(x [T, H], weights [T, k], ids [T, k]) bf16 on CUDA: four favoured experts, the rest
    at random (some without rows)."""
    from strata.engine.core.fast.moe_prefill import route_logits

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, HIDDEN, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    logits = torch.randn(tokens, NUM_EXPERTS, device="cuda", generator=gen)
    logits[:, :4] += 3.0
    weights, ids = route_logits(logits, TOP_K, True, torch.bfloat16)
    return x, weights, ids


def _reference(x, weights, ids, dense) -> torch.Tensor:
    """[T, H] in float32 by torch on gguf-py's values, token by token's routed experts."""
    gate, up, down = dense
    out = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
    for j in range(TOP_K):
        for expert in ids[:, j].unique().tolist():
            t = (ids[:, j] == expert).nonzero().squeeze(1)
            rows = x[t].float()
            act = (torch.nn.functional.silu(rows @ gate[expert].T) * (rows @ up[expert].T)
                   * weights[t, j, None].float())
            out[t] += act @ down[expert].T
    return out


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= REL_TOL * expected.float().abs().max().item(), (
        error, expected.float().abs().max().item())


def test_cuda_both_prefill_paths_match_torch_at_qwen3_30b_a3b_shape(monkeypatch,
                                                                    counted_paths) -> None:
    """512 tokens (4096 routed rows) through moe_prefill.experts_sorted: the grouped path
    with the crossover lowered to 8 rows per expert (4 groups of 32 experts), then
    expert_gemm at the default crossover; both within bf16 rounding of torch on gguf-py's
    float32 experts."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.quant import expert_gemm, expert_grouped

    for tuned in (expert_gemm._gate_up_tuned, expert_gemm._down_tuned):
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])  # minutes of compiles else
    blocks, dense = _layer(with_reference=True)
    moe = moe_stub(*blocks, top_k=TOP_K)
    assert expert_grouped.experts_per_group(*blocks) == 32
    x, weights, ids = _routing(512, seed=0)
    expected = _reference(x, weights, ids, dense)
    default = expert_grouped.DEQUANT_MIN_ROWS_PER_EXPERT
    monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", 8)
    assert expert_grouped.min_rows(NUM_EXPERTS) <= 512 * TOP_K
    _assert_close(moe_prefill.experts_sorted(moe, x, weights, ids), expected)
    assert counted_paths == {"gemm": 0, "grouped": 1}
    monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", default)
    assert expert_grouped.min_rows(NUM_EXPERTS) > 512 * TOP_K
    _assert_close(moe_prefill.experts_sorted(moe, x, weights, ids), expected)
    assert counted_paths == {"gemm": 1, "grouped": 1}


def test_cuda_graph_of_the_grouped_path_replays_with_new_routing(monkeypatch,
                                                                counted_paths) -> None:
    """The grouped path captured once (its groups' bounds and counts live on the device)
    and replayed with two other routings equals eager calls on them (the crossover lowered
    so 256 tokens take it)."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.quant import expert_grouped
    from strata.engine.core.quant.weight import reserve_scratch, scratch_bytes

    monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", 8)
    monkeypatch.setattr(expert_grouped, "REPLAYED_MIN_ROWS_PER_EXPERT", 8)  # what a capture uses

    blocks, _ = _layer()
    moe = moe_stub(*blocks, top_k=TOP_K)
    reserve_scratch(torch.device("cuda"), torch.bfloat16, expert_grouped.scratch_numel(*blocks))
    x, weights, ids = _routing(256, seed=1)
    moe_prefill.experts_sorted(moe, x, weights, ids)  # compile and tune outside capture
    held = scratch_bytes()
    graph, out = captured(lambda: moe_prefill.experts_sorted(moe, x, weights, ids))
    assert counted_paths["gemm"] == 0 and scratch_bytes() == held
    for seed in (2, 3):
        new_x, new_weights, new_ids = _routing(256, seed=seed)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        expected = moe_prefill.experts_sorted(moe, x, weights, ids)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_cuda_load_reserves_the_group_scratch_before_graphs(tmp_path, monkeypatch,
                                                            counted_paths) -> None:
    """A tiny Q4_K_M-like Qwen3-MoE loaded on CUDA with a scratch of 3 of its 8 experts:
    the load reserved it and the warm-up ran both paths; a prefill in chunks of 16 tokens
    (32 routed rows) takes expert_gemm, then, with the crossover lowered, the grouped path
    in three groups, which neither grows the scratch nor differs beyond bf16 rounding."""
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.fast.prefill import prefill
    from strata.engine.core.kv_cache import KVCache
    from strata.engine.core.quant import expert_grouped
    from strata.engine.core.quant.weight import scratch_bytes
    from tests.helpers.gguf_writer import write_tiny_q4_k_m_like_moe

    path, config = write_tiny_q4_k_m_like_moe(tmp_path / "moe.gguf")
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    per_expert = 2 * config.moe_intermediate_size * config.hidden_size * 2  # bf16 gate + up
    monkeypatch.setattr(expert_grouped, "EXPERT_SCRATCH_BYTES", 3 * per_expert)
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256))
    engine.load()
    try:
        assert counted_paths["gemm"] > 0 and counted_paths["grouped"] > 0  # the warm-up
        held = scratch_bytes()
        stacks = engine.model.model.layers[0].mlp.experts
        assert expert_grouped.experts_per_group(stacks.gate_proj, stacks.up_proj,
                                                stacks.down_proj) == 3
        assert held >= 2 * expert_grouped.scratch_numel(stacks.gate_proj, stacks.up_proj,
                                                        stacks.down_proj)
        ids = torch.tensor([(7 * i + 3) % 300 for i in range(40)], device="cuda")

        def logits() -> torch.Tensor:
            kv = KVCache.for_config(engine.model.config, 64, torch.bfloat16,
                                    torch.device("cuda"))
            return prefill(engine.model, kv, ids, 0, chunk_tokens=16, moe_impl="triton")

        grouped_before = counted_paths["grouped"]
        by_gemm = logits()
        assert counted_paths["grouped"] == grouped_before
        monkeypatch.setattr(expert_grouped, "DEQUANT_MIN_ROWS_PER_EXPERT", 1)
        by_grouped = logits()
        assert counted_paths["grouped"] > grouped_before and scratch_bytes() == held
        _assert_close(by_grouped, by_gemm)
    finally:
        engine.close()
