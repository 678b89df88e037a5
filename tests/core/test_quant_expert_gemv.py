"""The fused routed-expert kernels over GGML blocks (quant/expert_gemv.py) through Triton's CPU
interpreter: gate/up and down + weighted sum against torch on gguf-py's dequantized experts,
for every planes type, k in {1, 2, 3, 8}, with and without a partial cache's slot table (some
experts in slots, the rest read from the host copy), padded expert strides and mixed types.
tests/gpu/test_quant_expert_gemv_cuda.py repeats them on the GPU in bf16; the engine-level
greedy equality is in test_quant_experts.py.
"""

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

import gguf
from gguf import GGMLQuantizationType as QT

from strata.engine.core.quant.experts import QuantizedExperts
from tests.helpers.quant_blocks import random_blocks

PLANES_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K,
                QT.IQ2_XXS, QT.MXFP4]
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q2_K, QT.IQ2_XXS)
NUM_EXPERTS = 9
# Float32 throughout: only the summation order differs from torch (planes groups, then
# experts in order), so within this fraction of the output's scale.
REL_TOL = 2e-5


def _shape(qtype: QT) -> tuple[int, int]:
    """(H, I): 256-value super-blocks for K-quants (H of 3: a half-full last column tile),
    else 32-value blocks with I = 96 and H = 544 (partial row and column tiles of the
    interpreter's 256 x 512)."""
    return (768, 256) if qtype in K_QUANTS else (544, 96)


def stack(qtype: QT, rows: int, cols: int, seed: int, pad_bytes: int = 0,
          device: str = "cpu") -> tuple[QuantizedExperts, torch.Tensor]:
    """(QuantizedExperts [E, rows, cols] whose experts lie pad_bytes apart beyond their
    blocks, the float32 reference [E, rows, cols] from gguf-py)."""
    raw = random_blocks(qtype, NUM_EXPERTS * rows, cols, seed, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(NUM_EXPERTS, rows, cols)
    row_bytes = raw.shape[1]
    padded = torch.zeros(NUM_EXPERTS, rows * row_bytes + pad_bytes, dtype=torch.uint8)
    padded[:, : rows * row_bytes] = torch.from_numpy(raw).view(NUM_EXPERTS, -1)
    padded = padded.to(device)
    view = padded.as_strided((NUM_EXPERTS, rows, row_bytes), (padded.stride(0), row_bytes, 1))
    return QuantizedExperts(qtype, (NUM_EXPERTS, rows, cols), view, torch.float32), dense


def in_slots(host: QuantizedExperts, resident: dict[int, int], num_slots: int = 4,
             device: str = "cpu") -> tuple[QuantizedExperts, int]:
    """A partial cache over host: experts `resident` (expert -> slot) copied into slots of
    garbage, and the host copy's byte offset from the slots' base."""
    stride = host.expert_stride
    slots = torch.full((num_slots, stride), 0x55, dtype=torch.uint8, device=device)
    flat = host.raw.as_strided((host.num_experts, stride), (stride, 1))
    for expert, slot in resident.items():
        slots[slot] = flat[expert].to(device)
    _, rows, row_bytes = host.raw.shape
    view = slots.as_strided((num_slots, rows, row_bytes), (stride, row_bytes, 1))
    experts = QuantizedExperts(host.qtype, (num_slots, *host.shape[1:]), view, host.dtype)
    return experts, host.raw.data_ptr() - slots.data_ptr()


def slot_table(resident: dict[int, int]) -> torch.Tensor:
    """The device slot table [E] int32 of a partial cache: resident experts' slots, else -1."""
    table = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    for expert, slot in resident.items():
        table[expert] = slot
    return table


def reference(x, gate, up, down, ids, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(act [k, I], y [H]) by torch on the dequantized experts, in float64."""
    ids = ids.long().cpu()
    g = torch.einsum("kih,h->ki", gate[ids].double(), x.double().cpu())
    u = torch.einsum("kih,h->ki", up[ids].double(), x.double().cpu())
    act = torch.nn.functional.silu(g) * u
    y = (torch.einsum("khi,ki->kh", down[ids].double(), act)
         * weights.double().cpu()[:, None]).sum(0)
    return act, y


def assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    error = (got.double().cpu() - expected).abs().max().item()
    assert error <= rel * expected.abs().max().item(), (error, expected.abs().max().item())


def _routing(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(NUM_EXPERTS, generator=gen)[:k]
    weights = torch.rand(k, generator=gen) + 0.1
    return ids, weights / weights.sum()


def _x(hidden: int, seed: int) -> torch.Tensor:
    """Small enough that gate stays within silu's curve (random K-quant rows sum large)."""
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.02


def _projections(gate_type: QT, up_type: QT, down_type: QT, hidden: int, inter: int,
                 pad_bytes: int = 0):
    gate, gate_f = stack(gate_type, inter, hidden, seed=1, pad_bytes=pad_bytes)
    up, up_f = stack(up_type, inter, hidden, seed=2, pad_bytes=pad_bytes)
    down, down_f = stack(down_type, hidden, inter, seed=3, pad_bytes=pad_bytes)
    return (gate, up, down), (gate_f, up_f, down_f)


@pytest.mark.parametrize("k", [1, 2, 3, 8])  # 3: down_sum pads the experts to 4
@pytest.mark.parametrize("qtype", PLANES_TYPES, ids=lambda t: t.name)
def test_fused_experts_match_torch_on_the_dequantized_experts(qtype: QT, k: int) -> None:
    from strata.engine.core.quant import expert_gemv

    hidden, inter = _shape(qtype)
    blocks, dense = _projections(qtype, qtype, qtype, hidden, inter)
    assert expert_gemv.supports(*blocks)
    ids, weights = _routing(k, seed=k)
    x = _x(hidden, seed=k)
    act_expected, y_expected = reference(x, *dense, ids, weights)
    act = expert_gemv.gate_up(x, blocks[0], blocks[1], ids)
    assert act.shape == (k, inter) and act.dtype == x.dtype
    assert_close(act, act_expected)
    y = expert_gemv.down_sum(act, blocks[2], ids, weights)
    assert y.shape == (hidden,)
    assert_close(y, y_expected)
    torch.testing.assert_close(expert_gemv.routed_mlp(x, *blocks, ids, weights), y,
                               rtol=0, atol=0)  # deterministic: the same sum every time


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("qtype", PLANES_TYPES, ids=lambda t: t.name)
def test_fused_experts_read_slots_or_the_host_copy_through_the_table(qtype: QT, k: int) -> None:
    """A partial cache: experts 4, 1 and 7 in slots 2, 0 and 3 (slot 1 garbage), the others
    read in place from the host copy, whose experts lie 36 padding bytes apart. Slots and
    host copy each hold garbage where the other is to be read."""
    from strata.engine.core.quant import expert_gemv

    hidden, inter = _shape(qtype)
    host, dense = _projections(qtype, qtype, qtype, hidden, inter, pad_bytes=36)
    resident = {4: 2, 1: 0, 7: 3}
    slots, offsets = zip(*(in_slots(w, resident) for w in host))
    table = slot_table(resident)
    assert expert_gemv.supports(*slots, table, offsets)
    ids = torch.tensor([4, 5, 1, 0, 7, 2, 8, 6])[:k]  # slot, host, slot, host, ...
    weights = torch.linspace(0.3, 0.05, k)
    x = _x(hidden, seed=10 + k)
    _, y_expected = reference(x, *dense, ids, weights)
    # All resident (the stacked layout) first, for the bit-for-bit comparison below.
    stacked = expert_gemv.routed_mlp(x, *host, ids, weights)
    for w in host:  # the resident experts' host blocks garbage: only their slots are right
        for expert in resident:
            w.raw[expert].fill_(0x55)
    y = expert_gemv.routed_mlp(x, *slots, ids, weights, table, offsets)
    assert_close(y, y_expected)
    torch.testing.assert_close(y, stacked, rtol=0, atol=0)  # the same sum, in the same order


def test_fused_experts_take_a_different_type_per_projection() -> None:
    """A Q4_K_M-like layer: gate Q4_K (32 lanes) and up Q8_0 (16) in one kernel, down Q6_K."""
    from strata.engine.core.quant import expert_gemv

    blocks, dense = _projections(QT.Q4_K, QT.Q8_0, QT.Q6_K, hidden=768, inter=256)
    ids, weights = _routing(8, seed=4)
    x = _x(768, seed=4)
    _, y_expected = reference(x, *dense, ids, weights)
    assert_close(expert_gemv.routed_mlp(x, *blocks, ids, weights), y_expected)


def test_unsupported_types_and_misaligned_layouts_keep_the_dequantizing_path() -> None:
    from strata.engine.core.quant import expert_gemv

    iq, _ = stack(QT.IQ3_S, 8, 256, seed=0)
    assert not expert_gemv.is_supported(iq)  # no planes decoding
    q4k, _ = stack(QT.Q4_K, 8, 256, seed=0, pad_bytes=2)  # stride 2 mod 4: int32 scale reads
    assert not expert_gemv.is_supported(q4k)
    q8, _ = stack(QT.Q8_0, 8, 256, seed=0, pad_bytes=2)  # fp16 fields stay even: fine
    assert expert_gemv.is_supported(q8)
    assert not expert_gemv.is_supported(q8, host_offset=3, has_table=True)
    q4k, _ = stack(QT.Q4_K, 8, 256, seed=0, pad_bytes=4)
    assert expert_gemv.is_supported(q4k, host_offset=4, has_table=True)
    assert not expert_gemv.is_supported(q4k, host_offset=6, has_table=True)


# dp4a (bf16/fp16 x; Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ2_XXS): x and then the activations
# rounded to int8 per 32 values, so the references round them the same way
# (test_quant_dp4a.py's _int8_rounded).
# Experts pad_bytes apart: 2 for Q6_K, Q8_0 and Q4_0, whose experts then start at 0 and 2
# mod 4 in turn, as do Q6_K's 210-byte rows of I = 256 and Q4_0's 54-byte rows of I = 96.
# The fp16 outputs round to 2**-11.
DP4A_TOL = 2e-3
DP4A_PAD = {QT.Q4_K: 4, QT.Q5_K: 4, QT.Q6_K: 2, QT.Q8_0: 2, QT.Q4_0: 2, QT.IQ2_XXS: 2,
             QT.Q4_1: 2, QT.Q5_0: 2, QT.Q5_1: 2}


def _half_experts(experts: QuantizedExperts) -> QuantizedExperts:
    return QuantizedExperts(experts.qtype, experts.shape, experts.raw, torch.float16)


def _dp4a_reference(x, act, gate, up, down, ids, weights, rounded: tuple[bool, bool, bool]):
    """(act [k, I], y [H]) in float64 from the dequantized experts, with x (gate, up) and the
    kernel's act (down) rounded to int8 where that projection takes dp4a."""
    from tests.core.test_quant_dp4a import _int8_rounded

    ids = ids.long()
    xs = [(_int8_rounded(x[None])[0] if r else x.float()).double() for r in rounded[:2]]
    g = torch.einsum("kih,h->ki", gate[ids].double(), xs[0])
    u = torch.einsum("kih,h->ki", up[ids].double(), xs[1])
    a = (_int8_rounded(act) if rounded[2] else act.float()).double()
    y = (torch.einsum("khi,ki->kh", down[ids].double(), a)
         * weights.double()[:, None]).sum(0)
    return torch.nn.functional.silu(g) * u, y


def _dp4a_x(hidden: int, seed: int) -> torch.Tensor:
    """fp16 x small enough that Q6_K's large random values stay finite in fp16 outputs."""
    return (torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.05).half()


def _dp4a_layer(types: tuple[QT, QT, QT], hidden: int, inter: int,
                pad_bytes: int | tuple[int, int, int]):
    """(QuantizedExperts, dequantized [E, rows, cols]) of gate, up and down in `types`, each
    expert pad_bytes (one for all, or per projection) past the last's blocks."""
    blocks, dense = [], []
    pads = (pad_bytes,) * 3 if isinstance(pad_bytes, int) else pad_bytes
    for p, (qtype, (rows, cols)) in enumerate(zip(types, ((inter, hidden), (inter, hidden),
                                                          (hidden, inter)))):
        pad_bytes = pads[p]
        # Q4_0's values (q - 8) are a sixteenth of Q8_0's int8: a larger d keeps act normal
        # in fp16 (below 2**-14 it rounds to subnormal steps).
        scale = 0.03 if qtype == QT.Q4_0 else 0.002
        raw = random_blocks(qtype, NUM_EXPERTS * rows, cols, seed=p + 1, scale=scale)
        dense.append(torch.from_numpy(gguf.quants.dequantize(raw, qtype))
                     .view(NUM_EXPERTS, rows, cols))
        row_bytes = raw.shape[1]
        padded = torch.zeros(NUM_EXPERTS, rows * row_bytes + pad_bytes, dtype=torch.uint8)
        padded[:, : rows * row_bytes] = torch.from_numpy(raw).view(NUM_EXPERTS, -1)
        view = padded.as_strided((NUM_EXPERTS, rows, row_bytes),
                                 (padded.stride(0), row_bytes, 1))
        blocks.append(QuantizedExperts(qtype, (NUM_EXPERTS, rows, cols), view, torch.float16))
    return blocks, dense


@pytest.mark.parametrize("qtype", [QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.IQ2_XXS],
                         ids=lambda t: t.name)  # Q4_K: below
def test_dp4a_experts_equal_the_experts_times_int8_x_and_activations(qtype: QT) -> None:
    from strata.engine.core.quant import expert_gemv

    hidden, inter = (544, 96) if qtype in (QT.Q8_0, QT.Q4_0) else (512, 256)
    blocks, dense = _dp4a_layer((qtype,) * 3, hidden, inter, DP4A_PAD[qtype])
    x = _dp4a_x(hidden, seed=1)
    assert expert_gemv.supports(*blocks)
    assert all(expert_gemv.uses_dp4a(w, x) for w in blocks)
    ids, weights = _routing(3, seed=2)
    act = expert_gemv.gate_up(x, blocks[0], blocks[1], ids)
    y = expert_gemv.down_sum(act, blocks[2], ids, weights.half())
    act_expected, y_expected = _dp4a_reference(x, act, *dense, ids, weights.half(),
                                               (True, True, True))
    assert_close(act, act_expected, DP4A_TOL)
    assert_close(y, y_expected, DP4A_TOL)


@pytest.mark.parametrize("down_type", [QT.Q5_0, QT.Q8_0, QT.Q4_1, QT.Q5_1],
                         ids=lambda t: t.name)
def test_glm_q4_k_m_experts_take_dp4a_for_gate_up_and_the_fallback_down(down_type: QT) -> None:
    """GLM-4.5-Air's Q4_K_M experts: Q4_K gate/up, and a down of rows 1408 wide (not whole
    256-blocks) that llama-quantize writes in Q4_K's fallback Q5_0 (Q6_K's: Q8_0; older
    files' Q4_1, Q5_1). Here rows of 288 (9 blocks: Q5_0 rows of 198 bytes, at 0 and 2 mod 4
    in turn), experts 2 bytes apart: all three projections by dp4a, equal to the
    dequantized experts times x and act as they are rounded to int8."""
    from strata.engine.core.quant import expert_gemv

    blocks, dense = _dp4a_layer((QT.Q4_K, QT.Q4_K, down_type), 512, 288, (4, 4, 2))
    x = _dp4a_x(512, seed=6)
    assert expert_gemv.supports(*blocks)
    assert all(expert_gemv.uses_dp4a(w, x) for w in blocks)
    ids, weights = _routing(3, seed=7)
    y = expert_gemv.routed_mlp(x, *blocks, ids, weights.half())
    act = expert_gemv.gate_up(x, blocks[0], blocks[1], ids)
    _, y_expected = _dp4a_reference(x, act, *dense, ids, weights.half(), (True, True, True))
    assert_close(y, y_expected, DP4A_TOL)


def test_dp4a_experts_read_slots_or_the_host_copy_like_the_resident_ones() -> None:
    """Q6_K (realigned words) through a partial cache's table: the same sum as all resident,
    bit for bit, with the host copy's experts at 0 and 2 mod 4."""
    from strata.engine.core.quant import expert_gemv

    host, _ = _dp4a_layer((QT.Q6_K,) * 3, 256, 256, pad_bytes=2)  # rows of 210 bytes
    resident = {4: 2, 1: 0}
    slots, offsets = zip(*(in_slots(w, resident) for w in host))
    table = slot_table(resident)
    ids = torch.tensor([4, 5, 1])  # slot, host (an odd expert: 2 mod 4), slot
    weights = torch.tensor([0.5, 0.3, 0.2]).half()
    x = _dp4a_x(256, seed=3)
    stacked = expert_gemv.routed_mlp(x, *host, ids, weights)
    for w in host:  # the resident experts' host blocks garbage: only their slots are right
        for expert in resident:
            w.raw[expert].fill_(0x55)
    assert expert_gemv.supports(*slots, table, offsets)
    y = expert_gemv.routed_mlp(x, *slots, ids, weights, table, offsets)
    torch.testing.assert_close(y, stacked, rtol=0, atol=0)


def test_dp4a_and_planes_projections_mix_in_one_layer() -> None:
    """Gate Q4_K by dp4a, up Q2_K by planes in the same kernel, down Q8_0 by dp4a; float32
    x keeps planes everywhere."""
    from strata.engine.core.quant import expert_gemv

    blocks, dense = _dp4a_layer((QT.Q4_K, QT.Q2_K, QT.Q8_0), 512, 256, pad_bytes=4)
    x = _dp4a_x(512, seed=4)
    assert [expert_gemv.uses_dp4a(w, x) for w in blocks] == [True, False, True]
    assert not expert_gemv.uses_dp4a(blocks[0], x.float())
    ids, weights = _routing(2, seed=5)
    act = expert_gemv.gate_up(x, blocks[0], blocks[1], ids)
    y = expert_gemv.down_sum(act, blocks[2], ids, weights.half())
    act_expected, y_expected = _dp4a_reference(x, act, *dense, ids, weights.half(),
                                               (True, False, True))
    assert_close(act, act_expected, DP4A_TOL)
    assert_close(y, y_expected, DP4A_TOL)
