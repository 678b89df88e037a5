"""The batched decode MoE kernels (fast/moe_batch.py) in Triton's CPU interpreter, float32:
route, gate/up and down over a batch's (row, expert) pairs equal the reference module row by
row, with rows sharing experts (one leader reads the weights for all), padding rows, a partial
cache's slot table, and a batch step of a tiny Qwen3-MoE through them. The GPU twin is
tests/gpu/test_moe_batch_cuda.py."""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled")

from strata.engine.core.fast import batch_experts, moe_batch
from strata.engine.core.fast.moe_prefill import moe_block
from strata.engine.core.random_weights import build_random_model
from tests.helpers.fast_configs import TINY_CONFIGS

E, INTER, HIDDEN, TOP_K = 6, 24, 64, 2


def _experts(seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) * 0.2
                 for shape in ((E, INTER, HIDDEN), (E, INTER, HIDDEN), (E, HIDDEN, INTER)))


def _loop_reference(x, experts, ids, weights):
    """Row by row, expert by expert, in float64."""
    gate, up, down = (w.double() for w in experts)
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for b in range(x.shape[0]):
        xb = x[b].double()
        for j, e in enumerate(ids[b].tolist()):
            act = torch.nn.functional.silu(gate[e] @ xb) * (up[e] @ xb)
            out[b] += float(weights[b, j]) * (down[e] @ act)
    return out.float()


def _rows(num_rows: int, seed: int) -> torch.Tensor:
    """Rows where some repeat an earlier one (same experts: shared reads), like a bucket's
    padding rows, which all carry token 0."""
    x = torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))
    if num_rows > 2:
        x[num_rows // 2 :: 3] = x[0]
    return x


@pytest.mark.parametrize("num_rows", [2, 3, 4, 16])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_batched_kernels_equal_the_loop(num_rows: int, norm_topk: bool) -> None:
    experts = _experts(num_rows)
    router = torch.randn(E, HIDDEN, generator=torch.Generator().manual_seed(7))
    x = _rows(num_rows, seed=num_rows)
    weights, ids = moe_batch.router_topk_rows(x, router, TOP_K, norm_topk)
    probs = torch.softmax(x @ router.T, dim=-1)
    top_p, top_ids = torch.topk(probs, TOP_K, dim=-1)
    if norm_topk:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, top_p, rtol=1e-5, atol=1e-6)
    act = moe_batch.pairs_gate_up(x, experts[0], experts[1], ids)
    assert act.shape == (num_rows * TOP_K, INTER)
    got = moe_batch.pairs_down_sum(act, experts[2], ids, weights)
    torch.testing.assert_close(got, _loop_reference(x, experts, ids, weights), rtol=1e-5,
                               atol=1e-5)


def test_every_row_on_the_same_experts_and_all_experts_used() -> None:
    """One leader pair serves all 16 rows; then rows spread over every expert."""
    experts = _experts(1)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(16, TOP_K, generator=torch.Generator().manual_seed(4))
    for ids in (torch.tensor([[4, 1]] * 16),
                torch.tensor([[(b + j * 3) % E for j in range(TOP_K)] for b in range(16)])):
        act = moe_batch.pairs_gate_up(x, experts[0], experts[1], ids)
        got = moe_batch.pairs_down_sum(act, experts[2], ids, weights)
        torch.testing.assert_close(got, _loop_reference(x, experts, ids, weights), rtol=1e-5,
                                   atol=1e-5)


def test_the_slot_table_reads_slots_and_host_like_the_stacked_weights() -> None:
    """A partial cache's table: resident experts from shuffled slots (others garbage), the
    rest in place from the host copy, as moe_triton's one-token kernels read them."""
    host = _experts(5)
    num_slots = 4
    slots = tuple(torch.full((num_slots, *w.shape[1:]), 7.0) for w in host)
    table = torch.full((E,), -1, dtype=torch.int32)
    for slot, expert in zip((3, 0, 2), (1, 4, 5)):
        table[expert] = slot
        for s, h in zip(slots, host):
            s[slot] = h[expert]
    offsets = tuple((h.data_ptr() - s.data_ptr()) // h.element_size()
                    for h, s in zip(host, slots))
    x = _rows(4, seed=9)
    ids = torch.tensor([[1, 0], [5, 2], [1, 0], [4, 3]])
    weights = torch.rand(4, TOP_K, generator=torch.Generator().manual_seed(6))
    act = moe_batch.pairs_gate_up(x, slots[0], slots[1], ids, table, offsets[:2])
    got = moe_batch.pairs_down_sum(act, slots[2], ids, weights, table, offsets[2])
    torch.testing.assert_close(got, _loop_reference(x, host, ids, weights), rtol=1e-5,
                               atol=1e-5)


def test_experts_rows_is_the_moe_block() -> None:
    """The whole block on a tiny Qwen3-MoE layer == the prefill path and the module."""
    model = build_random_model(TINY_CONFIGS["qwen3_moe"], "cpu", torch.float32, seed=2,
                               std=0.15)
    moe = model.model.layers[1].mlp
    x = _rows(8, seed=11)
    with torch.inference_mode():
        got = batch_experts.experts_rows(moe, x)
        torch.testing.assert_close(got, moe_block(moe, x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, moe(x), rtol=1e-5, atol=1e-5)


def test_a_batch_step_through_the_kernels_equals_the_eager_batched_forward() -> None:
    """BatchDecoder with the Triton MoE (three rows padded to the bucket of 4) against the
    model's own batched forward: logits and K/V."""
    from strata.engine.core.fast import batch_graph
    from strata.engine.core.fast.batch_graph import BatchDecoder
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from tests.core.test_batch_graph import clones, filled_caches

    model = build_random_model(TINY_CONFIGS["qwen3_moe"], "cpu", torch.float32, seed=1,
                               std=0.15)
    lengths = [5, 40, 17]
    caches = filled_caches(model, lengths)
    expected_caches = clones(caches)
    calls = []
    original = batch_graph.experts_rows

    def counted(moe, x):
        calls.append(x.shape[0])
        return original(moe, x)

    decoder = BatchDecoder(model, EAGER_OPS, "triton", use_cuda_graphs=False,
                           fused_attention=False, min_bucket_tokens=16)
    try:
        batch_graph.experts_rows = counted
        got = decoder.forward([7, 19, 33], lengths, caches).clone()
    finally:
        batch_graph.experts_rows = original
    with torch.inference_mode():
        expected = model.forward_decode_batch(torch.tensor([7, 19, 33]), lengths,
                                              expected_caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert calls == [4]  # one MoE layer (layer 0 is dense), the bucket's 4 rows
    for kv, ref in zip(caches, expected_caches):
        for mine, theirs in zip((*kv.k, *kv.v), (*ref.k, *ref.v)):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_an_engine_batching_through_the_kernels_equals_each_sequence_alone(tmp_path) -> None:
    """Three greedy sequences (bucket 4, one padding row) through the step with the Triton
    MoE: each one's tokens equal the sequence run alone, or part at a near-tie."""
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.fast.batch_graph import BatchDecoder
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from strata.engine.protocol import SamplingSpec
    from tests.core.batch_helpers import alone, assert_same_or_near_tie, run_batch
    from tests.helpers.tiny_models import make_tiny_hf_model

    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", num_slots=3,
                                 prefill_chunk_tokens=64))
    engine.load()
    try:
        step = BatchDecoder(engine.model, EAGER_OPS, "triton", use_cuda_graphs=False,
                            fused_attention=False, min_bucket_tokens=16)
        engine._runner.batch = step
        chats = [[(13 * i + 7 * j) % 300 + 5 for j in range(3 + 2 * i)] for i in range(3)]
        spec = SamplingSpec(max_tokens=4)
        expected = [alone(engine, p, spec, i) for i, p in enumerate(chats)]
        got = run_batch(engine, {f"r{i}": (p, spec, i) for i, p in enumerate(chats)})
        for i, prompt in enumerate(chats):
            assert_same_or_near_tie(engine, prompt, expected[i], got.tokens[f"r{i}"])
        assert 4 in step._buffers
    finally:
        engine.close()
