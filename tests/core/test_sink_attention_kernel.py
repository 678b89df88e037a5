"""The fused sink prefill attention (kernels/sink_attention.py) against the torch reference
(models/gpt_oss.sink_attention) under Triton's CPU interpreter: windows, GQA, a first and a
later chunk, sizes that no block size divides, float32 and bf16 inputs."""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.kernels.sink_attention import fused_sink_attention
from strata.engine.core.models.gpt_oss import sink_attention

HEAD_DIM, KV_HEADS = 64, 2
# (queries T, keys S, BLOCK_M/N or None for block_plan's): a first chunk (T == S) and a later
# one (T < S); blocks of 16 give many query and key blocks from small tensors, so the masked
# edges and the unmasked middle all run; block_plan's 64x64 sees T > 64 and its 16 one query.
SHAPES = [(37, 37, (16, 16)), (21, 58, (16, 16)), (150, 150, None), (70, 230, None),
          (1, 45, None)]


def _inputs(num_tokens: int, num_keys: int, group: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(KV_HEADS * group, num_tokens, HEAD_DIM, generator=gen)
    keys, values = (torch.randn(KV_HEADS, num_keys, HEAD_DIM, generator=gen) for _ in range(2))
    sinks = torch.randn(KV_HEADS * group, generator=gen) * 2  # large enough to matter
    return q.to(dtype), keys.to(dtype), values.to(dtype), sinks


# Windows shorter and longer than a block of 16 (only the latter leaves unmasked blocks
# between the window's edge and the diagonal); bf16 at one group size (the interpreter is slow).
CASES = [pytest.param(t, s, blocks, group, window, dtype,
                      id=f"T{t}-S{s}-{'b16' if blocks else 'plan'}-g{group}-w{window}-"
                         f"{str(dtype).removeprefix('torch.')}")
         for t, s, blocks in SHAPES for window in (0, 5, 20)
         for group, dtype in ((2, torch.float32), (4, torch.float32), (2, torch.bfloat16))]


@pytest.mark.parametrize(("num_tokens", "num_keys", "blocks", "group", "window", "dtype"), CASES)
def test_matches_the_torch_sink_attention(num_tokens, num_keys, blocks, group, window, dtype):
    """Same output as the reference. bf16 tolerance as check_fused's; under the interpreter the
    bf16 tiles are upcast before tl.dot (its bf16 dot is wrong), so only the loads, stores
    and rounding of bf16 are exercised here: the GPU test covers bf16 dots."""
    q, keys, values, sinks = _inputs(num_tokens, num_keys, group, dtype)
    got = fused_sink_attention(q, keys, values, sinks, window, blocks=blocks)
    expected = sink_attention(q, keys, values, sinks, window)
    assert got.shape == expected.shape and got.dtype == dtype
    tolerance = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_the_sinks_the_window_and_the_scale_each_change_the_output():
    """Each input the kernel takes on top of plain causal attention reaches its output."""
    q, keys, values, sinks = _inputs(21, 58, 2, torch.float32)
    base = fused_sink_attention(q, keys, values, sinks, 5, blocks=(16, 16))
    changed = {
        "sinks": fused_sink_attention(q, keys, values, sinks + 3, 5, blocks=(16, 16)),
        "window": fused_sink_attention(q, keys, values, sinks, 0, blocks=(16, 16)),
        "scale": fused_sink_attention(q, keys, values, sinks, 5, 0.2, blocks=(16, 16)),
    }
    for name, out in changed.items():
        assert (out - base).abs().max() > 1e-2, name
    # The scale is the scores' factor: the reference's 1/sqrt(D) folded into q gives it too.
    torch.testing.assert_close(changed["scale"],
                               sink_attention(q * 0.2 * HEAD_DIM**0.5, keys, values, sinks, 5),
                               rtol=2e-5, atol=2e-5)


def test_reads_no_key_block_outside_the_window():
    """Key blocks no query of the chunk sees are skipped, not loaded and masked: NaNs there
    (e.g. a recycled cache's stale rows) leave the output finite and equal."""
    num_tokens, num_keys, window = 21, 90, 5
    q, keys, values, sinks = _inputs(num_tokens, num_keys, 2, torch.float32)
    expected = sink_attention(q, keys, values, sinks, window)
    first_seen = num_keys - num_tokens - window + 1  # the first query's oldest key
    stale = first_seen // 16 * 16  # blocks of 16 wholly before it
    assert stale >= 48
    keys[:, :stale], values[:, :stale] = float("nan"), float("nan")
    got = fused_sink_attention(q, keys, values, sinks, window, blocks=(16, 16))
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_reads_strided_caches_and_writes_rows_o_proj_reads():
    """K/V as attention_prefill passes them (a [S, Hkv, D] cache transposed, no copy), q
    transposed from [T, Hq, D]; the output is a view of contiguous [T, Hq, D]."""
    q, keys, values, sinks = _inputs(21, 58, 2, torch.float32)
    q_rows = q.transpose(0, 1).contiguous()  # [T, Hq, D]
    k_cache, v_cache = (x.transpose(0, 1).contiguous() for x in (keys, values))  # [S, Hkv, D]
    got = fused_sink_attention(q_rows.transpose(0, 1), k_cache.transpose(0, 1),
                               v_cache.transpose(0, 1), sinks, 5)
    assert got.transpose(0, 1).is_contiguous()
    torch.testing.assert_close(got, sink_attention(q, keys, values, sinks, 5), rtol=2e-5,
                               atol=2e-5)


def test_bad_shapes_are_one_line_errors():
    q, keys, values, sinks = _inputs(21, 58, 2, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        fused_sink_attention(q[:3], keys, values, sinks[:3], 0)
    with pytest.raises(ValueError, match="keys must include the queries"):
        fused_sink_attention(q, keys[:, :10], values[:, :10], sinks, 0)
    with pytest.raises(ValueError, match="one sink per query head"):
        fused_sink_attention(q, keys, values, sinks[:2], 0)
