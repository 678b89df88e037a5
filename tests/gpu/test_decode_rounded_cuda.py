"""The norm and SiLU·mul that round x to int8 in the same launch (fast/decode_rounded.py),
compiled: equal to the separate kernels then quantize_x, and chained by PDL into dp4a
products from a replayed CUDA graph. tests/core/test_decode_rounded.py runs them interpreted.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.gpu.gpu_helpers import captured
from tests.helpers.quant_blocks import random_blocks

pytestmark = pytest.mark.gpu


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").bfloat16()


# Llama-3-8B's and Qwen3-30B-A3B's hidden sizes, and one whose padded block has a spare group.
@pytest.mark.parametrize("hidden", [4096, 2048, 2080])
def test_cuda_norm_rounded_equals_the_norm_then_quantize_x(hidden: int) -> None:
    from strata.engine.core.fast import decode_dense, decode_rounded
    from strata.engine.core.quant.gemv_dp4a import quantize_x

    for y in (_rand(1, hidden), None):
        h, weight = _rand(1, hidden), _rand(hidden)
        h_sum, x, rounded = decode_rounded.add_rms_norm_rounded(h, y, weight, 1e-5)
        want_h, want_x = decode_dense.add_rms_norm(h, y, weight, 1e-5)
        assert torch.equal(h_sum, want_h) and torch.equal(x, want_x)
        for got, want in zip(rounded, quantize_x(want_x), strict=True):
            assert torch.equal(got, want)


@pytest.mark.parametrize("num_cols", [14336, 768])  # Llama-3-8B's intermediate, Qwen3-MoE's
def test_cuda_silu_mul_rounded_equals_silu_mul_rounded_once_then_quantize_x(
        num_cols: int) -> None:
    from strata.engine.core.fast import decode_rounded
    from strata.engine.core.quant.gemv_dp4a import quantize_x

    gate_up = _rand(1, 2 * num_cols)
    x, rounded = decode_rounded.silu_mul_rounded(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).bfloat16()
    # float32 silu by different instructions (torch's and Triton's exp): a rare ulp apart.
    assert (x.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    for got, expected in zip(rounded, quantize_x(x), strict=True):
        assert torch.equal(got, expected)


def test_cuda_rounded_kernels_chained_by_pdl_equal_serial_launches() -> None:
    """norm (rounding x) -> Q4_K gate/up -> SiLU·mul (rounding) -> Q6_K down, each a PDL
    secondary, replayed from a CUDA graph with new h: what serial launches give. A product
    that read the rounding before its kernel finished would give the previous replay's."""
    from strata.engine.core.fast import decode_rounded
    from strata.engine.core.kernels import pdl
    from strata.engine.core.quant import gemv_dp4a

    if not pdl.is_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    hidden, inter = 2048, 4096
    gate_up = torch.from_numpy(random_blocks(QT.Q4_K, 2 * inter, hidden, seed=1,
                                             scale=0.01)).cuda()
    down = torch.from_numpy(random_blocks(QT.Q6_K, hidden, inter, seed=2, scale=0.01)).cuda()
    h, y, norm = _rand(1, hidden), _rand(1, hidden), _rand(hidden)

    def chain(use_pdl: bool) -> torch.Tensor:
        _, x, rounded = decode_rounded.add_rms_norm_rounded(h, y, norm, 1e-5, use_pdl)
        gu = gemv_dp4a.matmul(x, gate_up, QT.Q4_K, 2 * inter, use_pdl=use_pdl, rounded=rounded)
        act, act_rounded = decode_rounded.silu_mul_rounded(gu, use_pdl)
        return gemv_dp4a.matmul(act, down, QT.Q6_K, hidden, use_pdl=use_pdl,
                                rounded=act_rounded)

    chain(True)  # compile and autotune outside the capture
    graph, out = captured(lambda: chain(True))
    for _ in range(5):
        h.copy_(_rand(1, hidden))
        graph.replay()
        torch.testing.assert_close(out, chain(False), rtol=0, atol=0)


# Llama-3-8B's heads (32 of 128 over 8 KV heads) and Qwen3-30B-A3B's (32 of 128 over 4, q/k
# norms), at a bucket of one split and one of many.
@pytest.mark.parametrize("num_keys", [64, 4096])
@pytest.mark.parametrize("kv_heads,qk_norm", [(8, False), (4, True)])
def test_cuda_attention_rounded_equals_the_attention_then_quantize_x(
        num_keys: int, kv_heads: int, qk_norm: bool) -> None:
    from types import SimpleNamespace

    from strata.engine.core.fast import decode_attention
    from strata.engine.core.quant.gemv_dp4a import quantize_x

    norm = SimpleNamespace(weight=_rand(128), eps=1e-6) if qk_norm else None
    attn = SimpleNamespace(num_heads=32, num_kv_heads=kv_heads, head_dim=128, q_norm=norm,
                           k_norm=norm)
    q, k, v = _rand(1, 32 * 128), _rand(1, kv_heads * 128), _rand(1, kv_heads * 128)
    angles = torch.rand(1, 128, device="cuda") * 6
    caches = [_rand(num_keys, kv_heads, 128) for _ in range(2)]
    args = (attn, q, k, v, angles.cos(), angles.sin())
    position = torch.tensor([num_keys * 3 // 4], device="cuda")
    keys = torch.arange(num_keys, device="cuda")
    plain = decode_attention.fused_decode_attention(*args, *[c.clone() for c in caches],
                                                    position, keys)
    out, rounded = decode_attention.fused_decode_attention_rounded(*args, *caches, position,
                                                                   keys)
    assert torch.equal(out, plain)
    for got, want in zip(rounded, quantize_x(out), strict=True):
        assert torch.equal(got, want)
