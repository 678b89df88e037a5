"""A fresh fast decoder whose first call is a prefill over K/V that another decoder wrote.

The CPU twin of the restart scenario of tests/snapshots/test_snapshots_cuda.py: decoder A
answers a prompt, the used K/V rows go to a new cache (what a snapshot restore does), and a
new decoder B (compiled element-wise ops, fused Triton decode attention, nothing warmed up)
starts with a prefill at start_pos > 0, then decodes. In float32 its greedy tokens must be
exactly the reference model's over the whole prompt, and its logits close to them.
"""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import (see test_fast_paths.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from strata.engine.core.fast import GraphDecoder, static_step
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import build_random_model
from strata.engine.protocol import SamplingSpec

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

CONFIG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, max_position_embeddings=512)
MAX_TOKENS = 96
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0)


def reference(model, prompt: list[int], num_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and per-step logits of the reference forward over the whole prompt."""
    kv = KVCache.for_config(model.config, MAX_TOKENS)
    with torch.inference_mode():
        logits = [model(torch.tensor(prompt), 0, kv)[-1]]
        tokens = [int(logits[-1].argmax())]
        for i in range(num_new - 1):
            logits.append(model(torch.tensor(tokens[-1:]), len(prompt) + i, kv)[-1])
            tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def fresh_decoder(model) -> GraphDecoder:
    decoder = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=True,
                           fused_attention=True, min_bucket_tokens=16, prefill_chunk_tokens=16)
    assert decoder.ops.is_compiled and decoder.ops.fused_attention, decoder.note
    return decoder


def test_fresh_decoder_continues_over_restored_kv(monkeypatch) -> None:
    model = build_random_model(CONFIG, "cpu", torch.float32, seed=5, std=0.15)
    first_prompt = [(11 * i + 2) % 96 for i in range(20)]
    kv_a = KVCache.for_config(model.config, MAX_TOKENS)
    answer = list(fresh_decoder(model).generate(kv_a, first_prompt, GREEDY, 6))
    assert answer == reference(model, first_prompt, 6)[0]
    # What the slot holds: the prompt and every answer token but the last; restored into a
    # new, zeroed cache as SlotCache.from_state does.
    num_cached = len(first_prompt) + len(answer) - 1
    kv_b = KVCache.for_config(model.config, MAX_TOKENS)
    for dst, src in zip((*kv_b.k, *kv_b.v), (*kv_a.k, *kv_a.v), strict=True):
        dst[:num_cached] = src[:num_cached]
    prompt = first_prompt + answer + [(5 * i + 7) % 96 for i in range(30)]
    expected, ref_logits = reference(model, prompt, 8)

    seen: list[torch.Tensor] = []  # each decode step's logits [V]
    segments = static_step.decode_step_segments  # what StaticStep.run runs

    def recording_segments(*args, **kwargs):
        logits = yield from segments(*args, **kwargs)
        seen.append(logits[0].clone())
        return logits

    monkeypatch.setattr(static_step, "decode_step_segments", recording_segments)
    decoder = fresh_decoder(model)  # first call: a prefill at start_pos > 0, then decode
    got = list(decoder.generate(kv_b, prompt[num_cached:], GREEDY, 8, start_pos=num_cached))
    assert got == expected
    for logits, ref in zip(seen, ref_logits[1:], strict=True):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_prefill_warm_up_compiles_what_later_prompts_run() -> None:
    """After the load-time warm-up, prompts of other lengths (more chunks, a one-token last
    chunk) reuse its compiled groups and give the eager prefill's logits."""
    import torch._dynamo

    model = build_random_model(CONFIG, "cpu", torch.float32, seed=6, std=0.15)
    # Chunks of 24: no chunk length below equals a model dimension (head_dim is 16).
    decoder = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=True,
                           prefill_chunk_tokens=24)
    assert decoder.warm_up_prefill() > 0
    eager = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=False,
                         prefill_chunk_tokens=24)
    assert eager.warm_up_prefill() == 0.0  # nothing to compile
    counters_before = dict(torch._dynamo.utils.counters["stats"])
    for num_tokens in (33, 43, 19, 48):  # 24 + 9, 24 + 19, 19, two full chunks
        ids = torch.arange(num_tokens) * 7 % 96
        kv_a = KVCache.for_config(model.config, MAX_TOKENS)
        kv_b = KVCache.for_config(model.config, MAX_TOKENS)
        torch.testing.assert_close(decoder.prefill(kv_a, ids, 0), eager.prefill(kv_b, ids, 0),
                                   rtol=1e-4, atol=1e-4)
    # No new compilation: the warm-up's variants served every length.
    assert torch._dynamo.utils.counters["stats"].get("unique_graphs", 0) == \
        counters_before.get("unique_graphs", 0)


def test_prefill_keeps_the_faster_element_wise_groups() -> None:
    """The load-time choice times one full chunk each way, keeps one, and either prefills
    what the eager decoder does; without compiled groups there is nothing to choose."""
    from strata.engine.core.fast.tuning import faster_prefill_ops

    model = build_random_model(CONFIG, "cpu", torch.float32, seed=7, std=0.15)
    decoder = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=True,
                           prefill_chunk_tokens=24)
    decoder.warm_up_prefill()
    seconds = decoder.choose_prefill_ops()
    assert set(seconds) == {"compiled", "eager"} and min(seconds.values()) > 0
    assert decoder.prefill_ops.is_compiled == (faster_prefill_ops(seconds) == "compiled")
    assert decoder.prefill_ops.moe_block is not None or not model.config.is_moe
    eager = GraphDecoder(model, use_cuda_graphs=False, compile_pointwise=False,
                         prefill_chunk_tokens=24)
    assert eager.choose_prefill_ops() == {}
    ids = torch.arange(43) * 5 % 96  # a full chunk and a short one
    kv_a, kv_b = (KVCache.for_config(model.config, MAX_TOKENS) for _ in range(2))
    torch.testing.assert_close(decoder.prefill(kv_a, ids, 0), eager.prefill(kv_b, ids, 0),
                               rtol=1e-4, atol=1e-4)


def test_eager_prefill_groups_need_a_clear_margin() -> None:
    from strata.engine.core.fast.tuning import faster_prefill_ops

    # One 4096-token chunk on an H200 (docs/bench-results/diag-prefill-ops-h200.txt).
    assert faster_prefill_ops({"compiled": 0.0411, "eager": 0.0342}) == "eager"  # SmolLM2
    assert faster_prefill_ops({"compiled": 0.1031, "eager": 0.1219}) == "compiled"  # Llama-3-8B
    assert faster_prefill_ops({"compiled": 0.1000, "eager": 0.0970}) == "compiled"  # within 5%
