"""The norm, SiLU·mul and attention-combine kernels that round x to int8 in the same launch
(fast/decode_rounded.py, decode_attention.py), through Triton's CPU interpreter: bit-equal to
the separate kernels then quantize_x, and a quantized decode step that takes them launches
quantize_x only for the MoE's activation rows, with the logits of the step that rounds x by
separate launches. tests/gpu/test_decode_fast.py and
test_quant_cuda.py run them compiled, in CUDA graphs, with PDL.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import decode_dense, decode_rounded, forward
from strata.engine.core.fast.pointwise import PointwiseOps
from strata.engine.core.quant import gemv_dp4a
from strata.engine.core.quant.weight import QuantizedWeight


def _rand(*shape: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_same_rounding(got: tuple, expected: tuple) -> None:
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


# 96: a hidden size whose padded block (128) has a group past it; 256 with an all-zero group.
@pytest.mark.parametrize("hidden", [96, 256])
@pytest.mark.parametrize("residual", [True, False])
def test_norm_rounded_equals_the_norm_then_quantize_x(hidden: int, residual: bool) -> None:
    h, y = _rand(1, hidden, seed=1), _rand(1, hidden, seed=2) if residual else None
    weight = _rand(hidden, seed=3)
    weight[32:64] = 0  # a group whose x is all zero: scale 0, no division by zero
    h_sum, x, rounded = decode_rounded.add_rms_norm_rounded(h, y, weight, 1e-6)
    want_h, want_x = decode_dense.add_rms_norm(h, y, weight, 1e-6)
    assert torch.equal(h_sum, want_h) and torch.equal(x, want_x)
    _assert_same_rounding(rounded, gemv_dp4a.quantize_x(want_x))
    assert (h_sum is h) == (not residual)  # no residual: h itself, as add_rms_norm returns


# 1056 values: 33 groups, two programs of 32 groups, the second with one.
@pytest.mark.parametrize("num_cols", [64, 1056])
def test_silu_mul_rounded_equals_silu_mul_rounded_once_then_quantize_x(num_cols: int) -> None:
    gate_up = _rand(1, 2 * num_cols, seed=4)
    x, rounded = decode_rounded.silu_mul_rounded(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    # fp32 math, one rounding; the interpreter's float32 -> bf16 truncates (a compiled
    # kernel rounds to nearest), so the low 16 bits are dropped here too.
    want32 = torch.nn.functional.silu(gate) * up
    want = (want32.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    assert torch.equal(x, want)
    _assert_same_rounding(rounded, gemv_dp4a.quantize_x(x))


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="one token of 16 values"):
        decode_rounded.add_rms_norm_rounded(_rand(1, 8, seed=0), None, torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="a multiple of 32"):
        decode_rounded.add_rms_norm_rounded(_rand(1, 48, seed=0), None, torch.ones(48), 1e-6)
    with pytest.raises(ValueError, match="multiple of 64 values"):
        decode_rounded.silu_mul_rounded(_rand(1, 96, seed=0))
    x = _rand(1, 256, seed=0)
    wrong = gemv_dp4a.quantize_x(_rand(1, 512, seed=0))
    with pytest.raises(ValueError, match="not quantize_x's of it"):
        gemv_dp4a.rounded_words(x, wrong)


def test_attention_rounded_equals_the_attention_then_quantize_x() -> None:
    """The combine kernel's rounding of the attention output (o_proj's x) is quantize_x's."""
    from types import SimpleNamespace

    from strata.engine.core.fast import decode_attention

    attn = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, q_norm=None, k_norm=None)
    num_keys = 80  # two splits
    q, k, v = _rand(1, 256, seed=5), _rand(1, 128, seed=6), _rand(1, 128, seed=7)
    angles = torch.rand(1, 64, generator=torch.Generator().manual_seed(8)) * 6
    caches = [_rand(num_keys, 2, 64, seed=9 + i) for i in range(2)]
    args = (attn, q, k, v, angles.cos(), angles.sin())
    position, keys = torch.tensor([50]), torch.arange(num_keys)
    plain = decode_attention.fused_decode_attention(*args, *[c.clone() for c in caches],
                                                    position, keys)
    out, rounded = decode_attention.fused_decode_attention_rounded(*args, *caches, position,
                                                                   keys)
    assert torch.equal(out, plain)
    _assert_same_rounding(rounded, gemv_dp4a.quantize_x(out))
    with pytest.raises(ValueError, match="heads of a multiple of 32"):
        decode_attention.fused_decode_attention_rounded(*args[:1], q.float(), *args[2:],
                                                        *caches, position, keys)


def _decode_logits(model, ops: PointwiseOps, moe_impl: str) -> list[torch.Tensor]:
    """Three decode steps (no prefill: the cache starts empty) of the fast forward."""
    from strata.engine.core.kv_cache import KVCache

    kv = KVCache.for_config(model.config, 16, torch.bfloat16)
    with torch.inference_mode():
        return [forward.decode_step(model, kv, torch.tensor([token]), torch.tensor([i]),
                                    torch.arange(16), ops, moe_impl)[0]
                for i, token in enumerate((5, 17, 42))]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_quantized_decode_step_rounds_x_in_the_kernels_that_make_it(
        kind: str, tmp_path, monkeypatch) -> None:
    """Q4_K_M-like blocks in bf16 (every product by dp4a): quantize_x runs once a layer, for
    o_proj's input (the attention's output), and the logits equal those of the step that
    rounds x by separate launches. The MoE's are bit-equal (the same x, the same rounding);
    the dense model's down projection reads SiLU·mul rounded once where the eager op rounds
    twice, so its logits agree within bf16's reach."""
    from strata.engine.core import engine as engine_module
    from strata.engine.core.engine import Engine, EngineConfig
    from tests.helpers import gguf_writer

    if kind == "llama":
        # Heads of 64: o_proj in Q4_K blocks, its x rounded by the attention's combine.
        path = gguf_writer.write_tiny_q4_k_m_like_llama(tmp_path / "q4_k_m.gguf", head_dim=64)
    else:
        path, _ = gguf_writer.write_tiny_q4_k_m_like_moe(tmp_path / "moe.gguf")
    monkeypatch.setattr(engine_module, "compute_dtype", lambda device, config: torch.bfloat16)
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64,
                                 snapshot_ram_budget_bytes=1 << 20))
    engine.load()
    calls = {"quantize_x": 0}
    quantize_x = gemv_dp4a.quantize_x

    def counted(*args, **kwargs):
        calls["quantize_x"] += 1
        return quantize_x(*args, **kwargs)

    monkeypatch.setattr(gemv_dp4a, "quantize_x", counted)
    try:
        model = engine.model
        ops = PointwiseOps(fused_attention=True, dense_kernels=True)
        moe_impl = "triton" if kind == "qwen3_moe" else "auto"
        fused = _decode_logits(model, ops, moe_impl)
        # Per layer and step: the MoE's k activation rows (made by the experts' gate/up kernel,
        # a program a few rows of one expert), and o_proj's x where its blocks meet heads of
        # less than 32 values (the tiny MoE's 16).
        layers = model.model.layers
        quantized_o = sum(isinstance(layer.self_attn.o_proj.weight, QuantizedWeight)
                          for layer in layers)
        assert quantized_o == len(layers)
        small_heads = layers[0].self_attn.head_dim % 32 != 0
        assert small_heads == (kind == "qwen3_moe")
        per_step = (len(layers) if kind == "qwen3_moe" else 0) + quantized_o * small_heads
        assert calls["quantize_x"] == 3 * per_step
        monkeypatch.setattr(forward, "_rounds_x", lambda *args: False)
        monkeypatch.setattr(forward, "takes_rounded_x", lambda *args: False)
        calls["quantize_x"] = 0
        separate = _decode_logits(model, ops, moe_impl)
        # Separately: the q/k/v pair's, gate/up's (the experts'), the down's, o_proj's and the
        # head's x.
        per_layer = 2 if kind == "qwen3_moe" else 3
        assert calls["quantize_x"] == 3 * (per_step + per_layer * len(layers) + 1
                                           + quantized_o * (not small_heads))
    finally:
        engine.close()
    for a, b in zip(fused, separate, strict=True):
        if kind == "qwen3_moe":
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max() <= 3e-2 * b.abs().max()
            assert a.argmax() == b.argmax()
