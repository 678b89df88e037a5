"""CPU parity of the fast paths for the families beyond the shared decoder: GLM-4.5's and
GPT-OSS's MoE (sigmoid and biased routing, the shared expert, expert biases, the clamped
SwiGLU, MXFP4 experts) and Gemma 3's and GPT-OSS's attention (windows, sinks, own scale),
against the reference forward, in float32 under Triton's CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
# Not on a CUDA machine, where the GPU tests in the same session need compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import prefill
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model
from strata.engine.protocol import SamplingSpec
from tests.helpers.fast_configs import TINY_CONFIGS
from tests.helpers.fast_reference import reference_greedy, tiny_gpt_oss, tiny_model

GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)


def test_glm4_moe_takes_the_fast_path(tmp_path) -> None:
    """GLM-4.5 from its transformers checkpoint (sigmoid routing with a seeded correction
    bias, 2 groups, routed scaling, a shared expert, partial RoPE): the engine builds the
    fast decoder, whose greedy tokens are the reference forward's."""
    from strata.engine.core.engine_config import EngineConfig
    from strata.engine.core.engine_setup import make_fast_decoder
    from strata.engine.core.fast_coverage import missing_features
    from strata.engine.core.loader.hf import load_hf_config, load_hf_tensors
    from strata.engine.core.models.build import build_model
    from tests.helpers.tiny_models import make_tiny_hf_model

    directory, _ = make_tiny_hf_model("glm4_moe", tmp_path)
    config = load_hf_config(directory)
    model = build_model(config, load_hf_tensors(directory, config))
    # Partial RoPE is no gap: its q/k rows are reordered at load (reorder_partial_rotary).
    assert missing_features(model) == []
    forced = EngineConfig(model_path=str(directory), device="cpu", fast_compile_pointwise=True)
    decoder, _ = make_fast_decoder(model, torch.device("cpu"), forced)
    assert decoder is not None and decoder.moe_impl in ("triton", "bmm")
    prompt = [(7 * i + 3) % config.vocab_size for i in range(21)]
    expected, _ = reference_greedy(model, prompt, 8, 40)
    got = list(decoder.generate(KVCache.for_config(config, 40), prompt, GREEDY, 8))
    assert got == expected
    for name, other in TINY_CONFIGS.items():  # the models the fast paths cover whole
        gaps = missing_features(build_random_model(other, dtype=torch.float32))
        assert gaps == [], name


def mxfp4_experts(moe) -> None:
    """Put the layer's expert stacks in MXFP4 blocks (gguf-py's quantizer), as a GPT-OSS GGUF
    holds them; the reference forward then multiplies the same blocks."""
    import gguf

    from strata.engine.core.quant.experts import QuantizedExperts

    for name in ("gate_proj", "up_proj", "down_proj"):
        values = getattr(moe.experts, name).detach()  # [E, N, K]
        raw = gguf.quants.quantize(values.reshape(-1, values.shape[-1]).numpy(),
                                   gguf.GGMLQuantizationType.MXFP4)
        blocks = torch.from_numpy(raw).view(values.shape[0], values.shape[1], -1)
        del moe.experts._parameters[name]
        setattr(moe.experts, name, QuantizedExperts(gguf.GGMLQuantizationType.MXFP4,
                                                    tuple(values.shape), blocks, values.dtype))


# (name, n_group, MXFP4 experts): GLM in one group (the Triton routers) and in two (the
# module's own routing), GPT-OSS with float and MXFP4 experts.
MOE_LAYER_CASES = [("glm4_moe", 1, False), ("glm4_moe", 2, False), ("gpt_oss", 1, False),
                   ("gpt_oss", 1, True)]


@needs_interpreter
@pytest.mark.parametrize("name,groups,mxfp4", MOE_LAYER_CASES)
def test_moe_layer_paths_match_reference(name: str, groups: int, mxfp4: bool,
                                         monkeypatch) -> None:
    """GLM-4.5's and GPT-OSS's MoE layers through every fast MoE path against the module:
    one token (Triton kernels, bmm), a batch step's rows (pair kernels; quantized: row by
    row), prefill rows (grouped GEMMs; quantized: the grouped dequantize path; and the
    per-expert loop). GPT-OSS's experts also as MXFP4 blocks (the tile decoder's GEMV)."""
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.fast.batch_experts import experts_rows
    from strata.engine.core.fast.moe_grouped import moe_forward, router_kind
    from strata.engine.core.quant import expert_grouped

    config = dataclasses.replace(TINY_CONFIGS[name], n_group=groups, topk_group=1)
    model = build_random_model(config, "cpu", torch.float32, seed=5, std=0.15)
    moe = model.model.layers[1].mlp
    assert (router_kind(moe) is None) == (groups > 1)  # groups: the module's own routing
    if name == "glm4_moe":  # corrections of both signs, as large as the scores' spread
        assert (moe.e_score_correction_bias < 0).any() and (moe.e_score_correction_bias > 0).any()
    if mxfp4:
        mxfp4_experts(moe)
    epilogues = []  # what the quantized prefill's grouped dequantize path was given
    grouped = expert_grouped.experts_mlp
    monkeypatch.setattr(expert_grouped, "experts_mlp", lambda *a, **k: (
        epilogues.append(k.get("epilogue")), grouped(*a, **k))[1])
    gen = torch.Generator().manual_seed(3)
    x = {rows: torch.randn(rows, 64, generator=gen) for rows in (1, 3, 13)}
    with torch.inference_mode():
        ref = {rows: moe(v) for rows, v in x.items()}
        got = {"triton": moe_forward(moe, x[1], "triton"),
               "batch": experts_rows(moe, x[3]),
               "prefill": moe_forward(moe, x[13], "triton")}
        if not mxfp4:
            got["bmm"] = moe_forward(moe, x[1], "bmm")
        monkeypatch.setattr(moe_prefill, "_grouped_mm_works", False)  # the per-expert loop
        got["prefill loop"] = moe_forward(moe, x[13], "triton")
    for path, y in got.items():
        rows = y.shape[0]
        torch.testing.assert_close(y, ref[rows], rtol=1e-5, atol=1e-5, msg=path)
    # MXFP4 prefill rows went through the grouped dequantize path with GPT-OSS's epilogue.
    assert [e is not None for e in epilogues] == ([True] if mxfp4 else [])
    # The features are really there: the correction bias and the clamp change the output.
    if name == "glm4_moe":
        with torch.inference_mode():
            moe.e_score_correction_bias.zero_()
            assert not torch.allclose(moe_forward(moe, x[13], "triton"), ref[13], atol=1e-3)
    else:
        gate = (x[13] @ moe.experts.gate_proj[0].T if not mxfp4 else None)
        assert gate is None or gate.max() > moe.activation.limit


@pytest.mark.parametrize("name", ["gemma3"])
def test_decode_step_logits_follow_the_reference_past_the_window(name: str) -> None:
    """Gemma 3's every decode step's logits (torch attention), not only the greedy picks:
    the prompt of 21 and the 10 steps after run well past the local layers' window of 5."""
    from strata.engine.core.fast.forward import decode_step

    model = tiny_model(name)
    prompt = [(7 * i + 3) % 96 for i in range(21)]
    tokens, ref_logits = reference_greedy(model, prompt, 10, 40)
    assert len(set(tokens)) > 2  # the picks are not one token repeated
    kv = KVCache.for_config(model.config, 40)
    with torch.inference_mode():
        logits = prefill(model, kv, torch.tensor(prompt), 0, chunk_tokens=8)
        torch.testing.assert_close(logits, ref_logits[0], rtol=1e-4, atol=1e-4)
        for i, token in enumerate(tokens[:-1]):
            step = decode_step(model, kv, torch.tensor([token]), torch.tensor([len(prompt) + i]),
                               torch.arange(40))[0]
            torch.testing.assert_close(step, ref_logits[i + 1], rtol=1e-4, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_decode_attention_kernels_of_every_layer_kind(name: str) -> None:
    """The fused and the batched decode attention against their torch twins for each kind of
    layer the model has: windowed (5 of 300 keys: most splits see none) and global; Gemma's
    (1 + w) q/k norms and own scale; GPT-OSS's sinks and biases."""
    from strata.engine.core.fast.batch_attention import check_batch_attention
    from strata.engine.core.fast.decode_attention import check_fused
    from strata.engine.core.fast.kernel_checks import attention_kinds

    model = tiny_gpt_oss() if name == "gpt_oss" else tiny_model(name)
    kinds = attention_kinds(model)
    assert sorted(a.sliding_window or 0 for a in kinds) == [0, 5]
    for attn in kinds:
        assert check_fused(attn, torch.float32, torch.device("cpu"), 300) == ""
        assert check_batch_attention(attn, torch.float32, torch.device("cpu"), 80) == ""


def test_sinks_and_windows_change_the_reference_decode_attention() -> None:
    """The torch decode attention (what the kernels are checked against) follows the model's
    own attention: with the layer's sinks and window, and not without them."""
    from strata.engine.core.fast.decode_attention import reference_decode_attention

    attn = tiny_gpt_oss().model.layers[0].self_attn  # windowed, with sinks
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n * 16, generator=gen) for n in (4, 2, 2))
    angles = torch.rand(1, 16, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    position, num_keys = 30, 40
    caches = [torch.randn(num_keys, 2, 16, generator=gen) for _ in range(2)]

    def attend() -> torch.Tensor:
        k_cache, v_cache = (c.clone() for c in caches)
        with torch.inference_mode():
            return reference_decode_attention(attn, q, k, v, cos, sin, k_cache, v_cache,
                                              torch.tensor([position]), torch.arange(num_keys))

    got = attend()
    # The model's own attention over the same cache, the new K/V written first.
    from strata.engine.core.models.layers import apply_rope

    k_cache, v_cache = (c.clone() for c in caches)
    q_rot = apply_rope(q.view(1, 4, 16), cos, sin)
    k_cache[position] = apply_rope(k.view(1, 2, 16), cos, sin)[0]
    v_cache[position] = v.view(2, 16)
    expected = attn._attend(q_rot, k_cache, v_cache, position + 1)  # [Hq, 1, D]
    torch.testing.assert_close(got, expected.transpose(0, 1).reshape(1, -1), rtol=1e-5,
                               atol=1e-5)
    for change in ("sinks", "window"):
        saved = attn.sinks, attn.sliding_window
        if change == "sinks":
            attn.sinks = None
        else:
            attn.sliding_window = None
        try:
            assert not torch.allclose(attend(), got, atol=1e-3), change
        finally:
            attn.sinks, attn.sliding_window = saved


@needs_interpreter
@pytest.mark.parametrize("fused_attention", [False, True])
def test_gpt_oss_attention_on_the_fast_paths(fused_attention: bool) -> None:
    """GPT-OSS's attention (sinks, alternating windows cut by the prompt, biases, YaRN) through
    the fast prefill (in chunks after cached tokens), every decode step's logits and the
    batched step, its MoE by the reference module: equal to the reference forward. The fast
    paths refuse the model only for its MoE side."""
    import dataclasses

    from strata.engine.core.fast.forward import decode_step
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from strata.engine.core.fast_coverage import missing_features

    model = tiny_gpt_oss()
    assert "attention sinks" not in missing_features(model)
    assert "sliding-window attention" not in missing_features(model)
    prompt = [(7 * i + 3) % 96 for i in range(21)]
    tokens, ref_logits = reference_greedy(model, prompt, 6, 40)
    kv = KVCache.for_config(model.config, 40)
    ops = dataclasses.replace(EAGER_OPS, fused_attention=fused_attention)
    with torch.inference_mode():
        prefill(model, kv, torch.tensor(prompt[:9]), 0, chunk_tokens=4, moe_impl="loop")
        logits = prefill(model, kv, torch.tensor(prompt[9:]), 9, chunk_tokens=8,
                         moe_impl="loop")
        torch.testing.assert_close(logits, ref_logits[0], rtol=1e-4, atol=1e-4)
        for i, token in enumerate(tokens[:-1]):
            step = decode_step(model, kv, torch.tensor([token]), torch.tensor([len(prompt) + i]),
                               torch.arange(40), ops, "loop")[0]
            torch.testing.assert_close(step, ref_logits[i + 1], rtol=1e-4, atol=1e-4)
    # Three sequences at once, each past the window, one row of padding.
    _assert_batched_step_matches(model, prompt, fused_attention)


@needs_interpreter
@pytest.mark.parametrize("fused_attention", [False, True])
def test_ministral3_query_temperature_on_the_fast_paths(fused_attention: bool) -> None:
    """Ministral 3's position-dependent query scale (period 8, so every prompt crosses it)
    through the fast prefill in chunks after cached tokens, every decode step's logits (torch
    and fused attention, the Triton dense kernels) and the batched step: equal to the
    reference forward, which without the scale would differ."""
    from strata.engine.core.fast.forward import decode_step
    from strata.engine.core.fast.pointwise import EAGER_OPS
    from strata.engine.core.fast_coverage import missing_features

    model = tiny_model("ministral3")
    assert missing_features(model) == []
    prompt = [(7 * i + 3) % 96 for i in range(21)]
    tokens, ref_logits = reference_greedy(model, prompt, 6, 40)
    kv = KVCache.for_config(model.config, 40)
    ops = dataclasses.replace(EAGER_OPS, fused_attention=fused_attention,
                              dense_kernels=fused_attention)
    with torch.inference_mode():
        prefill(model, kv, torch.tensor(prompt[:9]), 0, chunk_tokens=4)
        logits = prefill(model, kv, torch.tensor(prompt[9:]), 9, chunk_tokens=8)
        torch.testing.assert_close(logits, ref_logits[0], rtol=1e-4, atol=1e-4)
        for i, token in enumerate(tokens[:-1]):
            step = decode_step(model, kv, torch.tensor([token]), torch.tensor([len(prompt) + i]),
                               torch.arange(40), ops)[0]
            torch.testing.assert_close(step, ref_logits[i + 1], rtol=1e-4, atol=1e-4)
    # Query scales 1, 1 + 0.5 ln 4, 1 + 0.5 ln 3; one padding row.
    _assert_batched_step_matches(model, prompt, fused_attention)
    with torch.inference_mode():
        for layer in model.model.layers:  # guard: the scale changes the logits
            layer.self_attn.llama4_scaling = None
        unscaled = model(torch.tensor(prompt), 0, KVCache.for_config(model.config, 40))[-1]
    assert (unscaled - ref_logits[0]).abs().max() > 1e-2


def _assert_batched_step_matches(model, prompt: list[int], fused_attention: bool) -> None:
    """Three sequences of 6, 30 and 17 cached tokens of prompt + prompt stepped at once by the
    batched decoder (one row of padding): equal to the reference's forward_decode_batch."""
    from strata.engine.core.fast.batch_graph import BatchDecoder
    from strata.engine.core.fast.pointwise import EAGER_OPS

    lengths = [6, 30, 17]
    caches: list[KVCache] = []
    expected_caches: list[KVCache] = []
    for length in lengths:
        for target in (caches, expected_caches):
            target.append(KVCache.for_config(model.config, 40))
            with torch.inference_mode():
                model(torch.tensor(prompt + prompt)[:length], 0, target[-1])
    batch = BatchDecoder(model, EAGER_OPS, "loop", use_cuda_graphs=False,
                         fused_attention=fused_attention, min_bucket_tokens=8)
    got = batch.forward([7, 19, 33], lengths, caches).clone()
    with torch.inference_mode():
        expected = model.forward_decode_batch(torch.tensor([7, 19, 33]), lengths,
                                              expected_caches)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("triton_usable", [True, False])
def test_gpt_oss_prefill_attends_in_the_sink_kernel(monkeypatch, triton_usable: bool) -> None:
    """The fast prefill's GPT-OSS layers attend in kernels/sink_attention.py's kernel where
    Triton runs (the torch sink_attention is not called), in torch where it cannot, and both
    give the reference forward's logits and greedy tokens: a first chunk and later ones after
    cached tokens, past the windows of 5."""
    import importlib

    from strata.engine.core.fast.forward import decode_step
    from strata.engine.core.kernels import sink_attention as sink_kernel

    prefill_module = importlib.import_module("strata.engine.core.fast.prefill")
    calls = {"kernel": 0, "torch": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(sink_kernel, "fused_sink_attention",
                        counted("kernel", sink_kernel.fused_sink_attention))
    monkeypatch.setattr(prefill_module, "sink_attention",
                        counted("torch", prefill_module.sink_attention))
    if not triton_usable:
        monkeypatch.setattr(sink_kernel, "is_usable", lambda device: False)
    model = tiny_gpt_oss()
    prompt = [(5 * i + 2) % 96 for i in range(23)]
    tokens, ref_logits = reference_greedy(model, prompt, 5, 40)
    kv = KVCache.for_config(model.config, 40)
    with torch.inference_mode():
        prefill(model, kv, torch.tensor(prompt[:17]), 0, chunk_tokens=16, moe_impl="loop")
        logits = prefill(model, kv, torch.tensor(prompt[17:]), 17, chunk_tokens=4,
                         moe_impl="loop")
        torch.testing.assert_close(logits, ref_logits[0], rtol=1e-4, atol=1e-4)
        got = [int(logits.argmax())]
        for i in range(4):
            step = decode_step(model, kv, torch.tensor(got[-1:]), torch.tensor([len(prompt) + i]),
                               torch.arange(40))[0]
            got.append(int(step.argmax()))
    assert got == tokens
    used, unused = ("kernel", "torch") if triton_usable else ("torch", "kernel")
    assert calls[used] > 0 and calls[unused] == 0, calls
