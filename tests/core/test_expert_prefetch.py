"""The expert prefetch of one-token decode over a partial cache with CPU-computed misses
(fast/moe_prefetch.py), on the CPU (Triton interpreted): the tokens stay the all-resident
model's whatever the guess; a guess that is right makes the next layer's experts hits (the
promotion counts each layer by the table row it ran with); a wrong one only costs copies;
bad settings are refused in one line."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the first Triton import (see test_fast_paths.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.models.forced_routing import ForcedRouting, TraceGuess
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import RandomWeights
from tests.helpers.moe_cache_cpu import CONFIG, GREEDY, NUM_LAYERS, PROMPT, TOP_K, E
from tests.helpers.routing_trace import random_trace

NUM_NEW = 6
SLOTS = "10"  # of 24 experts, one pool for the three layers


def _build(expert_cache: str, mode: str):
    memory = ModelMemory(backend_for("cpu"), torch.float32, mode)
    model = memory.build(CONFIG, RandomWeights(torch.device("cpu"), std=0.15), expert_cache)
    return memory, model


def _generate(expert_cache: str, mode: str, prefetch: int = 0, recall: float | None = None):
    """(tokens, memory, per-layer (hits, misses) of the decode steps); close the memory.
    recall: forced routing, guessed from its trace at that recall (None: the model's own
    routes, guessed by the next layer's router)."""
    memory, model = _build(expert_cache, mode)
    decoder = GraphDecoder(model, moe_impl="triton", min_bucket_tokens=16,
                           step_hook=memory.promotion)
    forced = None
    if recall is not None:
        forced = ForcedRouting(random_trace(NUM_NEW + 1, NUM_LAYERS, E, TOP_K, 3), E,
                               torch.device("cpu"))
        forced.attach(model, decoder)
    if prefetch:
        memory.cpu_misses.start_prefetch(
            prefetch, TraceGuess(forced, recall) if forced is not None else None)
    kv = KVCache.for_config(CONFIG, 64)
    logits = decoder.prefill(kv, torch.tensor(PROMPT), 0)
    tokens = [decoder.sample_first(logits, GREEDY)]
    cache = memory.experts.cache if memory.promotion is not None else None
    before = (list(cache.layer_hits), list(cache.layer_misses)) if cache else None
    tokens += decoder.decode(kv, tokens[0], len(PROMPT), NUM_NEW - 1, GREEDY,
                             continue_request=True)
    counts = None
    if cache is not None:
        memory.promotion.before_step()  # count the last step
        counts = [(cache.layer_hits[i] - before[0][i], cache.layer_misses[i] - before[1][i])
                  for i in range(NUM_LAYERS)]
    if forced is not None:
        forced.detach()
    return tokens, memory, counts


def test_router_guess_prefetch_decodes_like_all_resident() -> None:
    want, memory, _ = _generate("all", "off")
    memory.close()
    got, memory, counts = _generate(SLOTS, "on", prefetch=TOP_K)
    try:
        assert got == want
        status = memory.experts.status()
        assert status["expert_prefetch"] == TOP_K and status["num_prefetched"] > 0
        assert 0.0 <= status["prefetch_recall"] <= 1.0
        assert status["num_prefetch_late"] == 0  # the CPU's copies are done on return
        scored = (status["num_prefetch_hits"] + status["num_prefetch_unused"])
        assert 0 < scored <= status["num_prefetched"]
        # Each decode step counted each layer's routed experts once, hit or miss.
        assert all(h + m == TOP_K * (NUM_NEW - 1) for h, m in counts)
    finally:
        memory.close()


def test_a_right_guess_makes_the_next_layers_hits_and_a_wrong_one_costs_copies() -> None:
    without, memory, base_counts = _generate(SLOTS, "on", recall=1.0)
    memory.close()
    right, memory, counts = _generate(SLOTS, "on", prefetch=TOP_K, recall=1.0)
    try:
        assert right == without  # forced routes: the same tokens, prefetched or not
        status = memory.experts.status()
        assert status["prefetch_recall"] == 1.0 and status["num_prefetch_unused"] == 0
        assert status["num_prefetch_hits"] > 0
        # Layers 1 and 2 had every expert guessed and copied in before their split, and
        # the promotion counted them by the row each ran with: no misses.
        assert [m for _, m in counts[1:]] == [0, 0]
        assert sum(m for _, m in base_counts[1:]) > 0  # which they had without prefetch
        assert all(h + m == TOP_K * (NUM_NEW - 1) for h, m in counts)
    finally:
        memory.close()
    wrong, memory, counts = _generate(SLOTS, "on", prefetch=TOP_K, recall=0.0)
    try:
        assert wrong == without
        status = memory.experts.status()
        assert status["prefetch_recall"] == 0.0 and status["num_prefetch_hits"] == 0
        assert status["num_prefetch_unused"] > 0
        assert all(h + m == TOP_K * (NUM_NEW - 1) for h, m in counts)
    finally:
        memory.close()


def test_bad_prefetch_settings_are_refused_in_one_line() -> None:
    memory, _ = _build(SLOTS, "on")
    try:
        with pytest.raises(ValueError, match="at least one expert a layer, not 0"):
            memory.cpu_misses.start_prefetch(0)
        assert memory.cpu_misses.prefetch is None
        memory.cpu_misses.promotion = None
        with pytest.raises(ValueError, match="needs a host copy the GPU reads in place"):
            memory.cpu_misses.start_prefetch(2)
    finally:
        memory.close()
    forced = ForcedRouting(random_trace(2, NUM_LAYERS, E, TOP_K, 0), E, torch.device("cpu"))
    for recall in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"recall must be in 0\.\.1"):
            TraceGuess(forced, recall)
    forced.advance()
    assert sorted(TraceGuess(forced, 1.0)(1, torch.zeros(1))) == sorted(
        forced.trace[0, 1].tolist())
    assert not set(TraceGuess(forced, 0.0)(1, torch.zeros(1))) & set(forced.trace[0, 1].tolist())


def test_a_step_is_counted_by_the_rows_its_layers_ran_with() -> None:
    """A prefetch changes the table between a step's layers: the promotion counts a layer's
    hits by the row it noted (ExpertPromotion.note_row), not by the table after the step."""
    memory, _ = _build(SLOTS, "off")
    try:
        store, promotion, cache = memory.experts, memory.promotion, memory.experts.cache
        resident = (store.table_mirror[0] >= 0).nonzero()[:TOP_K, 0]
        assert len(resident) == TOP_K
        store.step_ids[0, 0] = resident
        for noted, want_hits in ((False, TOP_K), (True, 0)):
            hits, misses = cache.layer_hits[0], cache.layer_misses[0]
            if noted:  # layer 0 ran with none of them in a slot
                promotion.note_row(0, torch.full_like(store.table_mirror[0], -1))
            promotion.after_step()
            promotion.before_step()
            assert (cache.layer_hits[0] - hits, cache.layer_misses[0] - misses) == (
                want_hits, TOP_K - want_hits)
    finally:
        memory.close()


@pytest.mark.parametrize("kind", ["softmax", "gpt_oss", "glm"])
def test_the_router_guess_is_the_layers_own_choice_on_its_own_input(kind) -> None:
    """RouterGuess on the CPU copy of a router chooses what the layer's routing chooses
    for the same x (the guess differs only by taking the previous layer's x): softmax
    routing, GPT-OSS's biased router, GLM-4.5's sigmoid scores plus selection bias."""
    from strata.engine.core.fast.moe_prefetch import RouterGuess
    from strata.engine.core.models.switch import Routing, SparseMoE

    torch.manual_seed(0)
    moe = SparseMoE(32, 16, 16, 4, norm_topk_prob=kind != "gpt_oss",
                    routing=Routing("sigmoid") if kind == "glm" else Routing(),
                    router_bias=kind == "gpt_oss", softmax_after_topk=kind == "gpt_oss")
    if kind == "glm":
        with torch.no_grad():  # a selection bias large enough to change the choice
            moe.e_score_correction_bias.copy_(torch.randn(16))
    guess = RouterGuess()
    guess.note(3, moe)
    assert guess(5, torch.zeros(32)) == []  # a layer not seen yet: no guess
    for _ in range(8):
        x = torch.randn(32)
        with torch.no_grad():
            _, ids = moe.route(x[None])
        assert sorted(guess(3, x)) == sorted(ids[0].tolist())
