"""The batched decode MoE kernels (fast/moe_batch.py) on the GPU: Qwen3-30B-A3B's expert shape
(128 experts, top 8, hidden 2048, 768 wide) in bf16 against the one-token kernels row by row
and a float64 loop, padding-like repeated rows, a CUDA graph replay equal to the eager call,
float32 exact (no tf32), and a tiny model's block equal to the prefill path. Times nothing."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.moe_stub import moe_stub

pytestmark = pytest.mark.gpu

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768


def _setup(num_rows: int, dtype: torch.dtype, seed: int, num_experts=E, hidden=HIDDEN,
           inter=INTER):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    experts = (rand(num_experts, inter, hidden, scale=0.02),
               rand(num_experts, inter, hidden, scale=0.02),
               rand(num_experts, hidden, inter, scale=0.02))
    router = rand(num_experts, hidden, scale=0.02)
    x = rand(num_rows, hidden, scale=1.0)
    if num_rows > 2:  # rows that repeat row 0, as a bucket's padding rows repeat token 0
        x[num_rows // 2 :: 3] = x[0]
    return experts, router, x


def _loop(x, experts, ids, weights, round_act: bool):
    """float64 row by row; round_act: the activations rounded to x's dtype between the
    projections, as the kernels store them."""
    gate, up, down = (w.double() for w in experts)
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64, device=x.device)
    for b in range(x.shape[0]):
        xb = x[b].double()
        for j, e in enumerate(ids[b].tolist()):
            act = torch.nn.functional.silu(gate[e] @ xb) * (up[e] @ xb)
            if round_act:
                act = act.to(x.dtype).double()
            out[b] += float(weights[b, j]) * (down[e] @ act)
    return out


def _check_routing(x, router, weights, ids, num_experts=E):
    """Each row's ids are torch's top-k of the float32 softmax, except at a near-tie."""
    logits = (x.float() @ router.float().T).to(x.dtype).float()
    probs = torch.softmax(logits, dim=-1)
    top_p, top_ids = torch.topk(probs, TOP_K + 1, dim=-1)
    for b in range(x.shape[0]):
        if set(ids[b].tolist()) != set(top_ids[b, :TOP_K].tolist()):
            margin = float(top_p[b, TOP_K - 1] - top_p[b, TOP_K])
            assert margin < 1e-3, f"row {b}: ids {ids[b].tolist()} vs {top_ids[b].tolist()}"
        else:
            expected = top_p[b, :TOP_K] / top_p[b, :TOP_K].sum()
            torch.testing.assert_close(weights[b].float().sort().values,
                                       expected.sort().values, rtol=2e-2, atol=2e-3)
    assert ids.min() >= 0 and ids.max() < num_experts


@pytest.mark.parametrize("num_rows", [3, 16])
def test_bf16_rows_match_the_one_token_kernels_and_the_loop(num_rows: int) -> None:
    from strata.engine.core.fast import moe_batch, moe_triton

    experts, router, x = _setup(num_rows, torch.bfloat16, seed=num_rows)
    weights, ids = moe_batch.router_topk_rows(x, router, TOP_K, True)
    _check_routing(x, router, weights, ids)
    act = moe_batch.pairs_gate_up(x, experts[0], experts[1], ids)
    got = moe_batch.pairs_down_sum(act, experts[2], ids, weights)
    assert got.shape == (num_rows, HIDDEN) and got.dtype == torch.bfloat16
    scale = float(got.float().abs().max())
    assert scale > 0
    # The same routing through the one-token kernels, row by row.
    one = torch.stack([
        moe_triton.grouped_down_sum(
            moe_triton.grouped_gate_up(x[b], experts[0], experts[1], ids[b]),
            experts[2], ids[b], weights[b])
        for b in range(num_rows)])
    torch.testing.assert_close(got.float(), one.float(), rtol=2e-2, atol=1e-2 * scale)
    ref = _loop(x, experts, ids, weights, round_act=True)
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=1e-2 * scale)


def test_a_graph_replay_equals_the_eager_call() -> None:
    """No host sync, fixed buffers: captured once, replayed on new inputs; the router's
    completion counter is back at 0 after each replay."""
    from strata.engine.core.fast import batch_experts
    from strata.engine.core.fast.moe_triton import _counter

    experts, router, x = _setup(16, torch.bfloat16, seed=5)
    router_module = torch.nn.Linear(HIDDEN, E, bias=False, device="cuda", dtype=torch.bfloat16)
    router_module.weight.data.copy_(router)
    moe = moe_stub(*experts, top_k=TOP_K, router=router_module)
    static_x = x.clone()
    for _ in range(2):  # compile and autotune outside the capture
        batch_experts.experts_rows(moe, static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = batch_experts.experts_rows(moe, static_x)
    for seed in (6, 7):
        _, _, new_x = _setup(16, torch.bfloat16, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert int(_counter(static_x.device).item()) == 0
        torch.testing.assert_close(static_out, batch_experts.experts_rows(moe, new_x), rtol=0,
                                   atol=0)


def test_float32_is_exact_and_the_block_is_the_prefill_path() -> None:
    """float32 weights multiply in IEEE float32 (tl.dot's tf32 would miss 1e-4); a small
    Qwen3-MoE layer's experts equal the prefill path's (grouped GEMMs) on the same routing."""
    from strata.engine.core.fast import batch_experts, moe_batch
    from strata.engine.core.fast.moe_prefill import experts_sorted
    from strata.engine.core.random_weights import build_random_model
    from tests.helpers.fast_configs import SMALL_CONFIGS

    experts, router, x = _setup(4, torch.float32, seed=8, num_experts=16, hidden=256,
                                inter=128)
    weights, ids = moe_batch.router_topk_rows(x, router, 4, True)
    act = moe_batch.pairs_gate_up(x, experts[0], experts[1], ids)
    got = moe_batch.pairs_down_sum(act, experts[2], ids, weights)
    ref = _loop(x, experts, ids, weights, round_act=False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)

    model = build_random_model(SMALL_CONFIGS["qwen3_moe"], "cuda", torch.bfloat16, seed=1)
    moe = model.model.layers[1].mlp
    rows = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got = batch_experts.experts_rows(moe, rows)
        weights, ids = moe_batch.router_topk_rows(rows, moe.router.weight, moe.top_k,
                                                  moe.norm_topk_prob)
        expected = experts_sorted(moe, rows, weights, ids)
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=2e-2 * scale)
