"""Decode over a partial expert cache (CPU, Triton interpreter): the same kernels, step and
hook as the CUDA-graph path give the tokens of the all-resident model, misses are read from
the host copy, and promotion leaves the experts the steps used in slots."""

from __future__ import annotations

import dataclasses
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
from strata.engine.core.memory.arena import ArenaReleasedError
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.residency import ModelMemory
from tests.helpers.moe_cache_cpu import CONFIG, GREEDY, NUM_LAYERS, PROMPT, TOP_K, E, build_on_cpu

NUM_NEW = 8


def _generate(decoder: GraphDecoder) -> list[int]:
    kv = KVCache.for_config(CONFIG, 64)
    return list(decoder.generate(kv, PROMPT, GREEDY, NUM_NEW))


@pytest.fixture(scope="module")
def resident_tokens() -> list[int]:
    memory, model = build_on_cpu(CONFIG, "all")
    try:
        assert memory.expert_mode == "all"
        # bmm: the stacked experts by another path (the Triton one runs slowly interpreted).
        tokens = _generate(GraphDecoder(model, moe_impl="bmm", min_bucket_tokens=16))
        with torch.inference_mode():  # the reference forward (per-expert loop) agrees
            logits = model(torch.tensor(PROMPT + tokens[:-1]), 0, KVCache.for_config(CONFIG, 64))
        assert logits[len(PROMPT) - 1 :].argmax(-1).tolist() == tokens
        return tokens
    finally:
        memory.close()


def test_partial_cache_decodes_like_all_resident_and_promotes(resident_tokens) -> None:
    # 8 slots for 24 experts: layers 1 and 2 start on the host.
    memory, model = build_on_cpu(CONFIG, str(E))
    try:
        store, promotion = memory.experts, memory.promotion
        assert memory.expert_mode == "slots" and promotion is not None
        decoder = GraphDecoder(model, moe_impl="triton", min_bucket_tokens=16,
                               step_hook=promotion)
        assert decoder.moe_impl == "triton" and decoder.step_hook is promotion
        kv = KVCache.for_config(CONFIG, 64)
        resident = store.cache.resident()
        logits = decoder.prefill(kv, torch.tensor(PROMPT), 0)  # staged: the slots stay
        assert store.cache.resident() == resident and store.status()["staged_bytes"] > 0
        tokens = [decoder.sample_first(logits, GREEDY)]
        # The table says what the cache holds.
        for layer, expert, slot in store.cache.resident():
            assert int(store.table[layer, expert]) == slot
        hits, misses = store.cache.num_hits, store.cache.num_misses
        store.release()  # a released cache refuses the step before it reads any slot
        with pytest.raises(ArenaReleasedError, match="'experts' is released"):
            next(decoder.decode(kv, tokens[0], len(PROMPT), 1, GREEDY, continue_request=True))
        store.refill()
        tokens += decoder.decode(kv, tokens[0], len(PROMPT), NUM_NEW - 1, GREEDY,
                                 continue_request=True)
        assert tokens == resident_tokens

        # Every step but the last (not yet collected) counted each routed expert once; some
        # were read from the host copy.
        num_counted = store.cache.num_hits - hits + store.cache.num_misses - misses
        assert num_counted == (NUM_NEW - 2) * NUM_LAYERS * TOP_K
        assert store.cache.num_misses > misses
        promotion.before_step()  # collect the last step: its experts are in slots now,
        promotion.land()  # or stayed on the host where they did not outrank a resident one
        promoted = 0
        for layer in range(NUM_LAYERS):
            for expert in store.step_ids[layer, 0].tolist():
                slot = store.cache.slot_of(layer, expert)
                assert int(store.table[layer, expert]) == (-1 if slot is None else slot)
                if slot is None:
                    continue
                promoted += 1
                for slots, host in zip(store.slot_weights, store.host_expert(layer, expert)):
                    assert torch.equal(slots[slot], host)
        assert promoted > 0
    finally:
        memory.close()


def test_bmm_over_a_partial_cache_falls_back_to_the_loop() -> None:
    memory, model = build_on_cpu(CONFIG, str(E))
    try:
        decoder = GraphDecoder(model, moe_impl="bmm", step_hook=memory.promotion)
        assert decoder.moe_impl == "loop" and decoder.step_hook is None
        assert "MoE loop" in decoder.note
    finally:
        memory.close()


def test_glm4_moe_over_a_partial_cache_answers_like_all_resident(tmp_path) -> None:
    """GLM-4.5's experts (sigmoid-routed, beside a shared expert that lives with the dense
    weights) go through the same expert store: a partial cache, its release, refill and
    shrink answer exactly as all resident, on the reference path the engine picks for GLM."""
    from tests.core.engine_memory_helpers import make_engine, run
    from tests.helpers.tiny_models import make_tiny_hf_model

    directory, _ = make_tiny_hf_model("glm4_moe", tmp_path)
    prompts = [PROMPT, [(5 * i + 1) % 96 for i in range(9)]]
    resident = make_engine(directory, tmp_path / "a", expert_cache="all")
    partial = make_engine(directory, tmp_path / "b", expert_cache="10")  # of 2 x 8 experts
    try:
        assert resident.fast is None and partial.fast is None  # the CPU: reference path
        expected = [run(resident, p) for p in prompts]
        status = partial.status()["experts"]
        assert status["mode"] == "slots" and status["num_slots"] == 10
        assert run(partial, prompts[0]) == expected[0]
        counters = partial.status()["experts"]
        assert counters["num_misses"] > 0 and counters["num_evictions"] > 0
        sparse = partial.model.model.layers[1].mlp
        assert sparse.expert_weights is not None  # routed experts come from the store
        assert not sparse.shared_experts.gate_proj.weight.is_meta  # the shared one is dense
        partial.release_experts()
        with pytest.raises(Exception, match="refill it first"):
            run(partial, prompts[1])
        partial.refill_experts()
        assert partial.memory.experts.verify_slots() == 0
        assert run(partial, prompts[1], slot=1) == expected[1]
        shrunk = partial.resize_experts(8)  # one layer's experts: the rest read from the host
        assert shrunk["num_slots"] == 8 and partial.status()["experts"]["num_slots"] == 8
        assert run(partial, prompts[0], slot=2) == expected[0]
    finally:
        partial.close()
        resident.close()


def test_glm_routing_bias_stays_float32_in_a_bf16_model(tmp_path) -> None:
    """The correction bias only chooses experts, by differences bf16 would round away at its
    magnitude: in a bf16 model it stays float32, in the weights arena, equal to the file's."""
    from strata.engine.core.loader.hf import load_hf_config
    from strata.engine.core.weight_source import FileWeights
    from tests.helpers.tiny_models import make_tiny_hf_model

    directory, hf_model = make_tiny_hf_model("glm4_moe", tmp_path)
    config = load_hf_config(directory)
    memory = ModelMemory(backend_for("cpu"), torch.bfloat16)
    try:
        model = memory.build(config, FileWeights.open(directory, config), "all")
        bias = model.model.layers[1].mlp.e_score_correction_bias
        assert bias.dtype == torch.float32 and model.model.layers[1].mlp.router.weight.dtype \
            == torch.bfloat16
        want = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
        assert torch.equal(bias, want)
        base = memory.weights.base_address
        assert base <= bias.data_ptr() < base + memory.weights.allocated_bytes
        with torch.inference_mode():  # and the model runs in bf16 around it
            logits = model(torch.tensor(PROMPT), 0, KVCache.for_config(config, 32, torch.bfloat16))
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    finally:
        memory.close()


@pytest.mark.parametrize("name", ["glm4_moe", "gpt_oss"])
def test_glm_and_gpt_oss_layers_read_a_partial_cache_like_the_reference(name: str) -> None:
    """GLM-4.5's routing and shared expert, GPT-OSS's routing, expert biases and clamp,
    through the fast kernels over a partial cache's slot table (misses read from the host
    copy; the biases, resident beside the router, by expert id): one token and a batch
    step's rows equal the reference loop, the step's ids are left for the cache, and a
    release and refill keep the answers."""
    from strata.engine.core.fast.batch_experts import experts_rows
    from strata.engine.core.fast.moe_grouped import moe_forward, slot_layout
    from tests.helpers.fast_configs import TINY_CONFIGS

    # 3 layers, 10 slots for 16 or 24 experts: the last layer's start on the host copy.
    config = dataclasses.replace(TINY_CONFIGS[name], num_hidden_layers=3)
    memory, model = build_on_cpu(config, "10")
    try:
        assert memory.expert_mode == "slots"
        moe = model.model.layers[2].mlp
        layout = slot_layout(moe)
        assert layout is not None and bool((layout.table < 0).any())
        gen = torch.Generator().manual_seed(4)
        one, rows = torch.randn(1, 64, generator=gen), torch.randn(3, 64, generator=gen)
        with torch.inference_mode():
            fast_one = moe_forward(moe, one, "triton")
            step_ids = layout.step_ids[0].clone()
            fast_rows = experts_rows(moe, rows, layout)
            _, want_ids = moe.route(one)
            assert torch.equal(step_ids, want_ids[0])  # what the cache promotes from
            torch.testing.assert_close(fast_one, moe(one), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fast_rows, moe(rows), rtol=1e-5, atol=1e-5)
            memory.experts.release()
            memory.experts.refill()
            torch.testing.assert_close(moe_forward(moe, one, "triton"), fast_one, rtol=1e-6,
                                       atol=1e-6)
    finally:
        memory.close()
