"""Quantized GGUF weights on the GPU: the compiled Triton kernels against gguf-py and torch.
Whole engines over quantized blocks are in test_quant_engine_cuda.py.

The CPU twins (tests/core/test_quant_kernels.py, test_quant_engine.py) run the same kernels
through Triton's interpreter in float32; here they run compiled, in bf16, autotuned.
"""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.engine.core.loader.quant_plan import KERNEL_QUANT_TYPES
from tests.gpu.gpu_helpers import captured
from tests.helpers.quant_blocks import random_blocks, random_pair

pytestmark = pytest.mark.gpu

ALL_TYPES = [QT[name] for name in KERNEL_QUANT_TYPES]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_dequantize_equals_gguf_py(qtype: QT) -> None:
    """Bit for bit in float32 (contraction off), and after rounding to bf16."""
    from strata.engine.core.quant import kernels

    raw = random_blocks(qtype, rows=64, cols=2048, seed=int(qtype))
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    blocks = torch.from_numpy(raw).cuda()
    got32 = kernels.dequantize(blocks, qtype, 2048, torch.float32).cpu()
    np.testing.assert_array_equal(got32.numpy(), expected.numpy())
    got16 = kernels.dequantize(blocks, qtype, 2048, torch.bfloat16).cpu()
    assert torch.equal(got16, expected.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_qlinear_matches_torch_for_1_to_16_tokens_and_prefill(qtype: QT) -> None:
    """bf16 activations, float32 accumulation: within 2% of the output's scale (tl.dot rounds
    the weights to bf16 for 2..16 tokens, as the dequantized bf16 model does; the int8
    kernel rounds x to 8 bits per group, about 0.5%)."""
    from strata.engine.core.quant.weight import QuantizedWeight, qlinear

    rows, cols = 384, 2048
    raw = random_blocks(qtype, rows, cols, seed=7, scale=0.01)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).cuda()
    weight = QuantizedWeight(qtype, (rows, cols), torch.from_numpy(raw).cuda(), torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(rows, device="cuda", generator=gen).bfloat16()
    for num_tokens in [*range(1, 17), 100]:
        x = torch.randn(num_tokens, cols, device="cuda", generator=gen).bfloat16()
        expected = torch.nn.functional.linear(x.float(), dense, bias.float())
        got = qlinear(x, weight, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, rows)
        error = (got.float() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert error <= 2e-2 * scale, (num_tokens, error, scale)


DP4A_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
              QT.IQ2_XXS, QT.MXFP4]
# Llama-3-8B's k/v, down and q/k/v fused rows (Q5_K: rows of Qwen3-30B-A3B's head, which an
# IQ2_XXS mix stores as Q5_K); and rows of 630 (Q6_K) / 578 (Q8_0) / 198 (IQ2_XXS) bytes,
# which start at 0 and 2 mod 4 in turn. IQ2_XXS: Qwen3-30B-A3B's k, q, o. Q4_0: Gemma-3-27B's
# q, gate and down (QAT), and rows of 306 bytes. MXFP4: gpt-oss-20b's 2880-wide rows of 1530
# bytes (at 0 and 2 mod 4, blocks at every byte); odd rows (not qlinear's): below. Q5_0:
# GLM-4.5-Air's shared-expert down (1408 wide: Q4_K_M's fallback) and rows of 374 bytes (at 0
# and 2 mod 4); Q4_1, Q5_1: SmolLM2-1.7B's q and down (older Q4_1 files), rows of 17 blocks.
DP4A_SHAPES = {QT.Q4_K: ((1024, 4096), (4096, 14336), (6144, 4096)),
               QT.Q5_K: ((1024, 4096), (4096, 14336), (16384, 2048)),
               QT.Q6_K: ((1024, 4096), (4096, 14336), (6144, 4096), (1000, 768)),
               QT.Q8_0: ((1024, 4096), (4096, 14336), (6144, 4096), (1000, 544)),
               QT.IQ2_XXS: ((512, 2048), (4096, 2048), (2048, 4096), (1000, 768)),
               QT.Q4_0: ((4096, 5376), (21504, 5376), (5376, 21504), (1000, 544)),
               QT.Q5_0: ((4096, 1408), (1000, 544), (4096, 5376)),
               QT.Q4_1: ((2048, 2048), (2048, 8192), (1000, 544)),
               QT.Q5_1: ((2048, 2048), (2048, 8192), (1000, 544)),
               QT.MXFP4: ((2880, 2880), (5760, 2880), (1000, 1024))}


def _int8_rounded_x(x: torch.Tensor) -> torch.Tensor:
    from strata.engine.core.quant import gemv_dp4a

    q, d, _ = gemv_dp4a.quantize_x(x)
    rounded = (q.float().view(x.shape[0], -1, 32) * d[:, :, None]).view(x.shape)
    assert (rounded - x.float()).abs().max() <= x.float().abs().max() / 127
    return rounded


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_cuda_dp4a_kernel_equals_the_weight_times_its_int8_x(qtype: QT) -> None:
    """The compiled dp4a GEMV (real dp4a and funnel shifts, signed int8 x against unsigned
    values) equals the dequantized weight times x as quantize_x rounded it, up to the bf16
    output; at Llama-3-8B's shapes, autotuned, with a bias on one."""
    from strata.engine.core.quant import gemv_dp4a
    from strata.engine.core.quant.weight import QuantizedWeight, qlinear

    gen = torch.Generator(device="cuda").manual_seed(3)
    for i, (rows, cols) in enumerate(DP4A_SHAPES[qtype]):
        raw = random_blocks(qtype, rows, cols, seed=rows, scale=0.01)
        dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).cuda()
        weight = QuantizedWeight(qtype, (rows, cols), torch.from_numpy(raw).cuda(),
                                 torch.bfloat16)
        x = torch.randn(1, cols, device="cuda", generator=gen).bfloat16()
        bias = torch.randn(rows, device="cuda", generator=gen).bfloat16() if i == 0 else None
        assert gemv_dp4a.is_enabled(x, qtype, weight.raw)
        expected = _int8_rounded_x(x) @ dense.T + (bias.float() if bias is not None else 0)
        got = qlinear(x, weight, bias).float()
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 8e-3 * scale, (rows, cols)


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_cuda_every_dp4a_candidate_tile_gives_the_same_product(qtype: QT) -> None:
    """Each of the type's candidate tiles (CONFIGS) launched directly, not autotuned: a tile
    whose compiled layout went wrong would otherwise hide until the tuner picked it."""
    from strata.engine.core.kernels import pdl
    from strata.engine.core.quant import gemv_dp4a
    from strata.engine.core.quant.lookup import lookup_table

    rows, cols = (1000, 768) if qtype == QT.Q6_K else (1000, 1024)  # partial row tiles
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=4, scale=0.01)).cuda()
    dense = torch.from_numpy(gguf.quants.dequantize(raw.cpu().numpy(), qtype)).cuda()
    x = torch.randn(1, cols, device="cuda").bfloat16()
    expected = _int8_rounded_x(x) @ dense.T
    xq, xd, xs = gemv_dp4a.quantize_x(x)
    group = gemv_dp4a.GROUP_VALUES[int(qtype)]
    # PREWAIT: the first step's weights loaded before the PDL wait (launched as a secondary)
    launches = [{"USE_PDL": False, "PREWAIT": False}]
    if pdl.is_supported(x.device):
        launches.append({"USE_PDL": True, "PREWAIT": True, "launch_pdl": True})
    for (block_rows, block_cols, warps, stages), how in itertools.product(
            gemv_dp4a.CONFIGS[int(qtype)], launches):
        out = torch.empty(1, rows, dtype=torch.bfloat16, device="cuda")
        gemv_dp4a._dp4a_kernel[(-(-rows // block_rows),)](
            xq.view(torch.int32), xd, xs, raw, lookup_table(x.device), x, out, N=rows,
            ROW_BYTES=raw.shape[1],
            num_groups=cols // group, QTYPE=int(qtype), GROUP=group, HAS_BIAS=False,
            EMULATE=False, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
            STAGES=stages, num_warps=warps, **how)
        error = (out.float() - expected).abs().max().item()
        assert error <= 8e-3 * expected.abs().max().item(), (block_rows, block_cols, warps, how)


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_cuda_decode_kernel_replays_from_a_cuda_graph(qtype: QT) -> None:
    """The decode kernel (dp4a: x's quantization too) allocates nothing that differs per
    call: captured once, a replay with new x gives the eager product."""
    from strata.engine.core.quant import kernels

    raw = torch.from_numpy(random_blocks(qtype, 1024, 2048, seed=2, scale=0.01)).cuda()
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    kernels.quant_matmul(x, raw, qtype, 1024)  # compile and autotune outside the capture
    graph, out = captured(lambda: kernels.quant_matmul(x, raw, qtype, 1024))
    x.copy_(torch.randn(1, 2048, device="cuda").bfloat16())
    graph.replay()
    torch.testing.assert_close(out, kernels.quant_matmul(x, raw, qtype, 1024), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
def test_cuda_dp4a_products_chained_by_pdl_equal_serial_launches(qtype: QT) -> None:
    """Three dp4a products, each one's output the next one's x, launched (with x's rounding)
    as PDL secondaries from a replayed CUDA graph: each replay with new x gives what the
    same products launched one after another give. A product that read x before the
    rounding of it finished would give the previous replay's numbers."""
    from strata.engine.core.kernels import pdl
    from strata.engine.core.quant import gemv_dp4a

    if not pdl.is_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    size = 2048
    weights = [torch.from_numpy(random_blocks(qtype, size, size, seed=10 + i, scale=0.01)).cuda()
               for i in range(3)]
    x = torch.randn(1, size, device="cuda").bfloat16()

    def chain(use_pdl: bool) -> torch.Tensor:
        y = x
        for raw in weights:
            y = gemv_dp4a.matmul(y, raw, qtype, size, use_pdl=use_pdl)
        return y

    chain(True)  # compile and autotune outside the capture
    graph, out = captured(lambda: chain(True))
    for _ in range(5):
        x.copy_(torch.randn(1, size, device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(out, chain(False), rtol=0, atol=0)


# (part a's type and rows, part b's type and rows, columns): Qwen3-30B-A3B's and
# Llama-3-8B's q+k and Q6_K v (Q4_K_M), and an IQ2_XXS mix's q+k and Q4_K v.
PAIR_SHAPES = [(QT.Q4_K, 4608, QT.Q6_K, 512, 2048), (QT.Q4_K, 5120, QT.Q6_K, 1024, 4096),
               (QT.IQ2_XXS, 4608, QT.Q4_K, 512, 2048)]


@pytest.mark.parametrize(("type_a", "rows_a", "type_b", "rows_b", "cols"), PAIR_SHAPES,
                         ids=[f"{a.name}-{b.name}-{c}" for a, _, b, _, c in PAIR_SHAPES])
def test_cuda_a_pair_of_types_equals_its_separate_products_and_replays(
        type_a: QT, rows_a: int, type_b: QT, rows_b: int, cols: int) -> None:
    """gemv_dp4a.matmul_pair (q/k/v of two types in one launch), autotuned, against each
    part's own dp4a product (other tiles may sum the groups in another order: within bf16
    rounding), and replayed from a CUDA graph with new x like its eager product."""
    from strata.engine.core.quant import gemv_dp4a

    raw_a, raw_b, pair = random_pair(type_a, rows_a, type_b, rows_b, cols, seed=5,
                                     scale=0.01, device="cuda")
    x = torch.randn(1, cols, device="cuda").bfloat16()
    bias = torch.randn(rows_a + rows_b, device="cuda").bfloat16()
    got = gemv_dp4a.matmul_pair(x, pair, bias).float()
    expected = torch.cat([
        gemv_dp4a.matmul(x, raw_a, type_a, rows_a, bias[:rows_a]),
        gemv_dp4a.matmul(x, raw_b, type_b, rows_b, bias[rows_a:])],
        dim=1).float()
    assert (got - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()
    graph, out = captured(lambda: gemv_dp4a.matmul_pair(x, pair, bias))
    x.copy_(torch.randn(1, cols, device="cuda").bfloat16())
    graph.replay()
    torch.testing.assert_close(out, gemv_dp4a.matmul_pair(x, pair, bias), rtol=0, atol=0)


def test_cuda_funnel_and_byte_perm_equal_their_emulated_twins() -> None:
    """shf.r.wrap at shifts 0, 8, 16, 24 and prmt (sign replication included) as compiled
    equal numpy's reading of the PTX manual, which the interpreter's twins are checked
    against (tests/core/test_quant_dp4a.py): the CPU tests then stand for the GPU."""
    from tests.helpers.dp4a_twins import check_twins

    check_twins("cuda", emulate=False, count=100_000, seed=1)


def test_cuda_mxfp4_rows_at_every_byte_equal_the_weight_times_its_int8_x() -> None:
    """MXFP4 rows of 17 blocks (289 bytes: rows start at every byte mod 4) by
    gemv_dp4a.matmul, autotuned, against the dequantized weight times x as
    quantize_x rounds it."""
    from strata.engine.core.quant import gemv_dp4a

    rows, cols = 1000, 544
    raw = random_blocks(QT.MXFP4, rows, cols, seed=5, scale=0.01)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, QT.MXFP4)).cuda()
    blocks = torch.from_numpy(raw).cuda()
    x = torch.randn(1, cols, device="cuda").bfloat16()
    expected = _int8_rounded_x(x) @ dense.T
    got = gemv_dp4a.matmul(x, blocks, QT.MXFP4, rows).float()
    assert (got - expected).abs().max().item() <= 8e-3 * expected.abs().max().item()
