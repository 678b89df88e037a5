"""The quantized experts' grouped prefill path replayed per layer from CUDA graphs
(fast/expert_graphs.py) on the GPU, at Qwen3-30B-A3B's expert shape: a key runs called,
then is captured, then replays; replays with new routing and chunk lengths (padded to a
shared bucket) equal the called path, for two layers; a moved prefill scratch drops the
graphs; static buffers that do not fit turn them off (called from then on); and a tiny
quantized Qwen3-MoE's called prefill replays them inside the engine's decoder with the
logits of the path without them.

The CPU twin of the padding it relies on: tests/core/test_quant_expert_grouped.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_quant_dequant_cuda import TOP_K, _assert_close, _layer, _routing

pytestmark = pytest.mark.gpu


def _sorted(tokens: int, seed: int):
    """(x, source, offsets, row weights) of a chunk's routed rows, as moe_prefill sorts them."""
    from strata.engine.core.fast.moe_prefill import sort_by_expert

    x, weights, ids = _routing(tokens, seed)
    order, source, offsets = sort_by_expert(ids, 128)
    return x, source, offsets, weights.reshape(-1).index_select(0, order)


def _scratch_for(blocks) -> None:
    from strata.engine.core.quant import expert_grouped
    from strata.engine.core.quant.weight import reserve_scratch

    reserve_scratch(torch.device("cuda"), torch.bfloat16, expert_grouped.scratch_numel(*blocks))


def test_cuda_replays_equal_the_called_path_for_new_routing_and_lengths(counted_paths) -> None:
    """Two layers of one kind; 512, 400 and 300 tokens share the 4096-row bucket, 1100
    tokens takes another. A bucket's first call runs called (the warm-up), every other
    (layer, bucket) is captured on its first call (one call traced) and replayed after (no
    call), and every result equals the called path's on the same rows."""
    from strata.engine.core.fast.expert_graphs import ExpertGraphs
    from strata.engine.core.quant import expert_grouped

    first, _ = _layer()
    second = tuple(type(b)(b.qtype, b.shape, b.raw.flip(0).contiguous(), b.dtype)
                   for b in first)  # other experts at other addresses
    layers = [first, second]
    _scratch_for(first)
    graphs = ExpertGraphs(torch.device("cuda"), max_tokens=2048, top_k=TOP_K)
    for blocks in layers:  # compile and tune outside any capture, as the load's warm-up does
        expert_grouped.experts_mlp(*_sorted(64, seed=0), *blocks)
    traced = []
    for step, tokens in enumerate((512, 400, 300, 1100, 1100, 1100)):
        inputs = _sorted(tokens, seed=10 + step)
        for blocks in layers:
            expected = expert_grouped.experts_mlp(*inputs, *blocks)
            before = counted_paths["grouped"]
            got = graphs.experts_mlp(*inputs, *blocks)
            traced.append(counted_paths["grouped"] - before)
            assert got.shape == expected.shape
            _assert_close(got, expected)
    # per step (layer 1, layer 2): warm-up, capture; capture, replay; replays; and again
    assert traced == [1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert len(graphs) == 4  # 2 layers x 2 buckets


def test_cuda_a_moved_scratch_drops_the_graphs(counted_paths) -> None:
    """The graphs write into the prefill scratch by address: when a larger one replaces it,
    the next call captures again (one call traced) and replays write the new one."""
    from strata.engine.core.fast.expert_graphs import ExpertGraphs
    from strata.engine.core.quant import expert_grouped
    from strata.engine.core.quant.weight import release_scratch, reserve_scratch, scratch_bytes

    blocks, _ = _layer()
    _scratch_for(blocks)
    graphs = ExpertGraphs(torch.device("cuda"), max_tokens=512, top_k=TOP_K)
    inputs = _sorted(512, seed=3)
    expected = expert_grouped.experts_mlp(*inputs, *blocks)
    for _ in range(3):  # warm-up, capture, replay
        _assert_close(graphs.experts_mlp(*inputs, *blocks), expected)
    assert len(graphs) == 1
    try:
        reserve_scratch(torch.device("cuda"), torch.bfloat16, scratch_bytes() // 2 + (1 << 20))
        traced = []
        for _ in range(2):
            before = counted_paths["grouped"]
            _assert_close(graphs.experts_mlp(*inputs, *blocks), expected)
            traced.append(counted_paths["grouped"] - before)
        assert traced == [1, 0] and len(graphs) == 1
    finally:
        release_scratch()


def test_cuda_buffers_that_do_not_fit_turn_the_graphs_off(counted_paths, monkeypatch) -> None:
    """Out of memory for the static buffers (a GPU shared to its last GiB): that call and
    every later one run called, with the called path's result, and nothing is held."""
    from strata.engine.core.fast import expert_graphs
    from strata.engine.core.quant import expert_grouped

    blocks, _ = _layer()
    _scratch_for(blocks)
    graphs = expert_graphs.ExpertGraphs(torch.device("cuda"), max_tokens=512, top_k=TOP_K)
    inputs = _sorted(512, seed=5)
    expected = expert_grouped.experts_mlp(*inputs, *blocks)
    _assert_close(graphs.experts_mlp(*inputs, *blocks), expected)  # the warm-up, called

    def no_room(**_):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (the test's)")

    monkeypatch.setattr(expert_graphs, "_Static", no_room)
    traced = []
    for _ in range(2):
        before = counted_paths["grouped"]
        _assert_close(graphs.experts_mlp(*inputs, *blocks), expected)
        traced.append(counted_paths["grouped"] - before)
    assert traced == [1, 1] and not graphs.is_on
    assert len(graphs) == 0 and graphs._static is None


def test_cuda_engine_prefill_replays_expert_graphs_with_the_same_logits(tmp_path,
                                                                         monkeypatch) -> None:
    """A tiny Qwen3-MoE with Q4_K_M's expert types, all experts resident, loaded on CUDA
    (STRATA_EXPERT_GRAPHS unset: on by default): its decoder turned expert graphs on; a 200-token prompt
    (the crossover lowered so its chunk takes the grouped path) captures them in its first
    prefills and replays them after, with the logits of the prefill without them, within
    bf16 rounding; dropping the prefill graphs (every release does) drops them."""
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.kv_cache import KVCache
    from strata.engine.core.quant import expert_grouped
    from tests.helpers.gguf_writer import write_tiny_q4_k_m_like_moe

    path, _ = write_tiny_q4_k_m_like_moe(tmp_path / "moe.gguf")
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    monkeypatch.delenv("STRATA_EXPERT_GRAPHS", raising=False)  # the default
    monkeypatch.setattr(expert_grouped, "REPLAYED_MIN_ROWS_PER_EXPERT", 1)
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256))
    engine.load()
    try:
        prefiller = engine.fast.prefiller
        graphs = prefiller.expert_graphs
        assert graphs is not None and engine.memory.expert_mode == "all"
        ids = torch.tensor([(7 * i + 3) % 300 for i in range(200)], device="cuda")

        def logits() -> torch.Tensor:
            kv = KVCache.for_config(engine.model.config, 256, torch.bfloat16,
                                    torch.device("cuda"))
            return prefiller.called(kv, ids, 0)

        runs = [logits() for _ in range(3)]  # called, captured, replayed
        assert len(graphs) > 0
        prefiller.expert_graphs = None
        without = logits()
        prefiller.expert_graphs = graphs
        for got in runs:
            _assert_close(got, without)
        engine.fast.drop_prefill_graphs()
        assert len(graphs) == 0
    finally:
        engine.close()
