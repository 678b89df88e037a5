"""CPU forms of MoE experts (quant/cpu_experts.py) and their byte-bounded cache
(memory/cpu_expert_cache.py): each GGML type's FFN on the CPU equals the FFN of gguf-py's
dequantized weights within the form's documented error; Q4_K exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from strata.engine.core.memory.backend import backend_for
from strata.engine.core.memory.cpu_expert_cache import CpuExpertCache
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.quant.cpu_experts import (
    INT8_MAX_ERROR,
    HostEpilogue,
    Projection,
    cpu_expert,
    dequantized,
    expert_ffn,
    routed_ffn,
)
from tests.helpers.quant_blocks import random_blocks

HIDDEN, INTER = 256, 512  # whole K-quant blocks both ways
EXACT = 1e-5  # float32: the scale's and zero's rounding, nothing more
BF16 = 1e-2  # bf16 activations and scales (4e-3 measured)
# int8 rows: each weight within INT8_MAX_ERROR of its row's max; over a K-long dot of
# random signs the output's error stays a small multiple of that.
INT8 = 8 * INT8_MAX_ERROR


def _projection(qtype: QT | None, rows: int, cols: int, seed: int) -> Projection:
    if qtype is None:
        g = torch.Generator().manual_seed(seed)
        return Projection(torch.randn(rows, cols, generator=g) * 0.05, None, rows, cols)
    blocks = torch.from_numpy(random_blocks(qtype, rows, cols, seed, scale=0.01))
    return Projection(blocks, qtype, rows, cols)


def _exact(p: Projection) -> torch.Tensor:
    return p.data.float() if p.qtype is None else dequantized(p.data, p.qtype, p.rows, p.cols)


def _reference(x: torch.Tensor, gate: Projection, up: Projection, down: Projection,
               bias=None, limit=None, alpha=1.0) -> torch.Tensor:
    g, u = F.linear(x, _exact(gate)), F.linear(x, _exact(up))
    if bias is not None:
        g, u = g + bias[0], u + bias[1]
    if limit is None:
        act = F.silu(g) * u
    else:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        act = g * torch.sigmoid(g * alpha) * (u + 1)
    y = F.linear(act, _exact(down))
    return y if bias is None else y + bias[2]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize(("qtype", "kind", "dtype", "tolerance"), [
    (QT.Q4_K, "int4", torch.float32, EXACT),
    (QT.Q4_K, "int4", torch.bfloat16, BF16),
    (QT.Q6_K, "int8", torch.float32, INT8),
    (QT.Q8_0, "int8", torch.float32, INT8),
    (QT.Q5_0, "int8", torch.float32, INT8),
    (QT.Q4_0, "int8", torch.float32, INT8),
    (QT.MXFP4, "int8", torch.float32, INT8),
    (None, "dense", torch.float32, EXACT),
], ids=["Q4_K-f32", "Q4_K-bf16", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "MXFP4", "float"])
def test_expert_ffn_equals_the_dequantized_reference(qtype, kind, dtype, tolerance) -> None:
    gate, up = _projection(qtype, INTER, HIDDEN, 1), _projection(qtype, INTER, HIDDEN, 2)
    down = _projection(qtype, HIDDEN, INTER, 3)
    expert = cpu_expert(gate, up, down, dtype)
    assert expert.gate_up.kind == kind and expert.down.kind == kind
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    want = _reference(x, gate, up, down)
    assert _error(expert_ffn(x.to(dtype), expert, 0), want) < tolerance
    if kind == "dense":  # a view of the host copy when the dtypes agree: no bytes kept
        assert expert.nbytes == 0 and expert.down.weight.data_ptr() == down.data.data_ptr()


def test_q4k_gate_up_with_a_q6k_down_mixes_forms() -> None:
    """A Q4_K_M file's expert: gate and up exact int4, down int8 per row."""
    gate, up = _projection(QT.Q4_K, INTER, HIDDEN, 4), _projection(QT.Q4_K, INTER, HIDDEN, 5)
    down = _projection(QT.Q6_K, HIDDEN, INTER, 6)
    expert = cpu_expert(gate, up, down, torch.float32)
    assert (expert.gate_up.kind, expert.down.kind) == ("int4", "int8")
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert _error(expert_ffn(x, expert, 0), _reference(x, gate, up, down)) < INT8


def test_gpt_oss_epilogue_and_routed_sum() -> None:
    """Biases per expert id and the clamped SwiGLU, as ExpertActivation; the routed sum
    weighs each expert's output."""
    g = torch.Generator().manual_seed(7)
    num_experts, limit, alpha = 4, 0.5, 1.702
    biases = (torch.randn(num_experts, INTER, generator=g) * 0.3,
              torch.randn(num_experts, INTER, generator=g) * 0.3,
              torch.randn(num_experts, HIDDEN, generator=g) * 0.3)
    epilogue = HostEpilogue(*biases, limit=limit, alpha=alpha)
    experts, refs = [], []
    for e in (1, 3):
        gate, up = _projection(QT.Q4_K, INTER, HIDDEN, 10 + e), _projection(QT.Q4_K, INTER, HIDDEN, 20 + e)
        down = _projection(QT.Q4_K, HIDDEN, INTER, 30 + e)
        experts.append(cpu_expert(gate, up, down, torch.float32))
        refs.append((gate, up, down))
    x = torch.randn(HIDDEN, generator=g) * 4  # large enough that the clamp bites
    want = sum(w * _reference(x[None], *ref, bias=[b[e] for b in biases], limit=limit,
                              alpha=alpha)[0]
               for w, e, ref in zip((0.7, 0.3), (1, 3), refs))
    got = routed_ffn(x, experts, [1, 3], [0.7, 0.3], epilogue)
    assert _error(got, want) < EXACT
    plain = routed_ffn(x, experts, [1, 3], [0.7, 0.3])  # the epilogue changes the answer
    assert _error(plain, want) > 0.05


class _Blocks:
    """A stacked quantized source as the loader gives ExpertStore one (weight_source.py)."""

    def __init__(self, qtype: QT, num_experts: int, rows: int, cols: int, seed: int):
        self.qtype, self.dtype = qtype, torch.uint8
        self.blocks = torch.from_numpy(random_blocks(qtype, num_experts * rows, cols, seed,
                                                     scale=0.01)).view(num_experts, rows, -1)
        self.logical_shape = (num_experts, rows, cols)
        self.shape = tuple(self.blocks.shape)

    def copy_to(self, dst: torch.Tensor) -> None:
        dst.copy_(self.blocks)


def _store(num_experts: int = 4) -> ExpertStore:
    layers = {layer: (_Blocks(QT.Q4_K, num_experts, INTER, HIDDEN, 3 * layer),
                      _Blocks(QT.Q4_K, num_experts, INTER, HIDDEN, 3 * layer + 1),
                      _Blocks(QT.Q6_K, num_experts, HIDDEN, INTER, 3 * layer + 2))
              for layer in (0, 1)}
    return ExpertStore(layers, num_experts, backend_for("cpu"), num_experts_per_tok=2)


def test_cache_converts_once_counts_and_holds_its_byte_bound() -> None:
    store = _store()
    try:
        one = CpuExpertCache(store, 1 << 40, torch.float32).expert(0, 0).nbytes
        cache = CpuExpertCache(store, 2 * one, torch.float32)  # room for two experts
        first = cache.expert(0, 1)
        assert cache.expert(0, 1) is first and cache.num_conversions == 1
        cache.expert(1, 2)
        cache.expert(0, 1)  # used again: (1, 2) is now the least recent
        cache.expert(1, 3)
        assert cache.num_conversions == 3 and cache.num_evictions == 1
        assert (0, 1) in cache and (1, 2) not in cache and (1, 3) in cache
        assert cache.nbytes == 2 * one <= cache.limit_bytes
        # The form is the host copy's expert: its FFN equals gguf-py's dequantized one.
        gate, up, down = cache.projections(1, 3)
        x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(2))
        assert _error(expert_ffn(x, cache.expert(1, 3), 3), _reference(x, gate, up, down)) < INT8
        assert cache.status()["num_cpu_conversions"] == 3
        tiny = CpuExpertCache(store, 1, torch.float32)  # smaller than one: keeps the last
        tiny.expert(0, 0)
        tiny.expert(0, 1)
        assert len(tiny) == 1 and (0, 1) in tiny and tiny.num_evictions == 1
    finally:
        store.close()


def test_cache_refuses_a_negative_limit() -> None:
    store = _store()
    try:
        with pytest.raises(ValueError, match="must be >= 0 bytes"):
            CpuExpertCache(store, -1, torch.float32)
    finally:
        store.close()


def test_experts_without_a_cpu_form_are_refused_in_one_line() -> None:
    """Q8_K (llama.cpp's intermediate type: gguf-py cannot dequantize it) has no CPU form:
    the cache refuses the store with a line that says what to do."""
    from gguf import GGML_QUANT_SIZES

    block_size, block_bytes = GGML_QUANT_SIZES[QT.Q8_K]

    class _Raw(_Blocks):
        def __init__(self, rows: int, cols: int):
            self.qtype, self.dtype = QT.Q8_K, torch.uint8
            self.blocks = torch.zeros(4, rows, cols // block_size * block_bytes,
                                      dtype=torch.uint8)
            self.logical_shape = (4, rows, cols)
            self.shape = tuple(self.blocks.shape)

    store = ExpertStore({0: (_Raw(INTER, HIDDEN), _Raw(INTER, HIDDEN), _Raw(HIDDEN, INTER))},
                        4, backend_for("cpu"), num_experts_per_tok=2)
    try:
        with pytest.raises(ValueError, match=r"^layer 0's experts are Q8_K, which has no CPU "
                                             r"form .*set cpu_expert_misses to off$"):
            CpuExpertCache(store, 1 << 30, torch.float32)
    finally:
        store.close()
