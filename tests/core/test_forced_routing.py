"""Forced routing (models/forced_routing.py), a benchmark's hook: with it the reference module
and the one-token Triton router take the trace's ids, weighted by the router's own
probabilities of them; without it both route exactly as before."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled")

from strata.engine.core.models.forced_routing import ForcedLayer, ForcedRouting
from strata.engine.core.models.switch import SparseMoE

HIDDEN, INTER, E, TOP_K = 32, 24, 8, 3
CPU = torch.device("cpu")


def _moe(norm_topk: bool, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, INTER, E, TOP_K, norm_topk)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe


def _reference(moe: SparseMoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The MoE block with the given ids [T, k] and the router's probabilities of them."""
    probs = F.softmax(moe.router(x).float(), dim=-1)  # [T, E]
    weights = probs.gather(-1, ids)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            experts = moe.experts
            act = F.silu(experts.gate_proj[e] @ x[t]) * (experts.up_proj[e] @ x[t])
            out[t] += weights[t, j] * (experts.down_proj[e] @ act)
    return out


def _unforced(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """SparseMoE.forward as it was before the hook existed."""
    probs = F.softmax(moe.router(x).float(), dim=-1)
    top_probs, top_ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
    top_probs = top_probs.to(x.dtype)
    out = torch.zeros_like(x)
    experts = moe.experts
    for expert_id in torch.unique(top_ids).tolist():
        token_idx, slot_idx = torch.where(top_ids == expert_id)
        h = x[token_idx]
        y = F.linear(F.silu(F.linear(h, experts.gate_proj[expert_id]))
                     * F.linear(h, experts.up_proj[expert_id]), experts.down_proj[expert_id])
        out.index_add_(0, token_idx, y * top_probs[token_idx, slot_idx, None])
    return out


def _trace(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)[:, None, :]  # [steps, 1 layer, k]


def _least_likely(moe: SparseMoE, x: torch.Tensor) -> list[int]:
    """The k experts the router ranks last for x[0]: surely not what it would pick."""
    return torch.topk(moe.router(x[:1]).float(), TOP_K, largest=False).indices[0].tolist()


@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_reference_module_routes_the_forced_ids(norm_topk: bool) -> None:
    moe = _moe(norm_topk)
    x = torch.randn(1, HIDDEN)
    forced_row = _least_likely(moe, x)
    forced = ForcedRouting(_trace([forced_row, [0, 1, 2]]), E, CPU)
    moe.forced = ForcedLayer(forced, 0)
    forced.advance()  # step 0's row
    out = moe(x)
    torch.testing.assert_close(out, _reference(moe, x, torch.tensor([forced_row])))
    assert not torch.allclose(out, _unforced(moe, x))  # the router's own choice differs
    forced.advance()  # step 1's row
    torch.testing.assert_close(moe(x), _reference(moe, x, torch.tensor([[0, 1, 2]])))
    forced.advance()  # the trace cycles
    torch.testing.assert_close(moe(x), _reference(moe, x, torch.tensor([forced_row])))


@pytest.mark.parametrize("family", ["gpt-oss", "glm"])
def test_every_routing_takes_the_forced_ids_weighted_as_its_own_choice(family: str) -> None:
    """GPT-OSS (biased router, softmax over the k chosen logits) and GLM-4.5 (sigmoid scores,
    renormalised, scaled) route the trace's ids too: before, only softmax routing took them,
    and a budget benchmark of those families measured their own repeating routes (all hits)."""
    from strata.engine.core.models.switch import Routing

    torch.manual_seed(0)
    if family == "gpt-oss":
        moe = SparseMoE(HIDDEN, INTER, E, TOP_K, False, router_bias=True,
                        softmax_after_topk=True)
    else:
        moe = SparseMoE(HIDDEN, INTER, E, TOP_K, True, routing=Routing("sigmoid", 2.5))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, HIDDEN)
    forced_row = _least_likely(moe, x)
    own_weights, own_ids = moe.route(x)
    assert own_ids[0].tolist() != forced_row
    forced = ForcedRouting(_trace([forced_row]), E, CPU)
    moe.forced = ForcedLayer(forced, 0)
    forced.advance()
    weights, ids = moe.route(x)
    assert ids.tolist() == [forced_row, forced_row]
    chosen = moe.router(x).float().gather(-1, ids)
    if family == "gpt-oss":
        expected = F.softmax(chosen, dim=-1)
    else:
        scores = torch.sigmoid(chosen)
        expected = 2.5 * scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(weights, expected)
    moe.forced = None  # detached: its own routes again, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(moe.route(x), (own_weights, own_ids)))


def test_prefill_chunks_take_the_prefill_rows_in_order_per_layer() -> None:
    moe = _moe(True)
    x = torch.randn(5, HIDDEN)
    forced = ForcedRouting(_trace([[0, 1, 2]]), E, CPU)
    prefill = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(7)]).to(torch.int32)
    forced.set_prefill(prefill[:, None, :])
    moe.forced = ForcedLayer(forced, 0)
    torch.testing.assert_close(moe(x), _reference(moe, x, prefill[:5].long()))
    # The next chunk goes on from token 5, cycling past the trace's end.
    rows = prefill[[5, 6, 0, 1, 2]].long()
    torch.testing.assert_close(moe(x), _reference(moe, x, rows))


def test_without_forcing_the_module_is_bit_identical_to_before() -> None:
    moe = _moe(True)
    x = torch.randn(6, HIDDEN)
    assert moe.forced is None
    assert torch.equal(moe(x), _unforced(moe, x))


@needs_interpreter
@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_triton_router_returns_the_forced_ids_and_their_probabilities(norm_topk) -> None:
    from strata.engine.core.fast.moe_triton import _counter, router_topk

    gen = torch.Generator().manual_seed(5)
    router = torch.randn(100, 96, generator=gen) * 0.3  # 100 experts: not a power of 2
    x = torch.randn(96, generator=gen)
    probs = torch.softmax(router @ x, dim=-1)
    forced_ids = torch.tensor([99, 0, 42, 7, 63, 1], dtype=torch.int32)
    out_ids = torch.zeros(6, dtype=torch.long)
    for _ in range(2):  # a persistent buffer read at each launch, as a graph replay reads it
        expected = probs[forced_ids.long()]
        if norm_topk:
            expected = expected / expected.sum()
        weights, ids = router_topk(x, router, 6, norm_topk, out_ids=out_ids,
                                   forced_ids=forced_ids)
        assert ids is out_ids and ids.tolist() == forced_ids.tolist()
        torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
        assert _counter(x.device).item() == 0
        forced_ids.copy_(torch.tensor([3, 4, 5, 6, 8, 9], dtype=torch.int32))
    # Without forcing: the router's own top-k, as before.
    top_p, top_ids = torch.topk(probs, 6)
    weights, ids = router_topk(x, router, 6, False)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, top_p, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="forced_ids must be a contiguous int32"):
        router_topk(x, router, 6, False, forced_ids=forced_ids.long())


@needs_interpreter
@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_triton_decode_path_equals_the_reference_with_the_forced_ids(norm_topk) -> None:
    from strata.engine.core.fast.moe_grouped import moe_forward

    moe = _moe(norm_topk, seed=3)
    x = torch.randn(1, HIDDEN)
    own = moe_forward(moe, x, "triton")
    torch.testing.assert_close(own, _unforced(moe, x), rtol=1e-4, atol=1e-5)
    forced_row = _least_likely(moe, x)
    forced = ForcedRouting(_trace([forced_row]), E, CPU)
    moe.forced = ForcedLayer(forced, 0)
    out = moe_forward(moe, x, "triton")
    torch.testing.assert_close(out, _reference(moe, x, torch.tensor([forced_row])),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, moe(x), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, own, rtol=1e-4, atol=1e-5)


def test_bad_traces_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        ForcedRouting(_trace([[1, 1, 2]]), E, CPU)
    with pytest.raises(ValueError, match=r"0\.\.7"):
        ForcedRouting(_trace([[1, 2, 8]]), E, CPU)
    with pytest.raises(ValueError, match="tokens, layers, k"):
        ForcedRouting(torch.zeros(3, 3, dtype=torch.int32), E, CPU)
    forced = ForcedRouting(_trace([[1, 2, 3]]), E, CPU)
    with pytest.raises(ValueError, match="one row a step"):
        forced.after_step(2)
