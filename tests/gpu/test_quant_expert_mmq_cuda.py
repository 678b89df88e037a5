"""The int8 grouped GEMMs over quantized experts (quant/expert_mmq.py) compiled on the GPU: a
512-token chunk at GLM-4.5-Air's expert shape (E=128, H=4096, I=1408, k=8; gate and up Q4_K,
down Q5_0 or Q8_0) and Qwen3-30B-A3B's (down Q6_K) against the dequantize-then-grouped-GEMM
path, within the int8 rounding of the rows; each type's product against torch on gguf-py's
dequantized experts and the same int8 rows (integer sums: float32 rounding only); every tile
candidate; a CUDA graph replayed with new routing; the autotuner's timing loop.

The CPU twin: tests/core/test_quant_expert_mmq.py (interpreter).
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.gpu.gpu_helpers import captured
from tests.helpers.child_env import child_env
from tests.helpers.int8_rows import dequantized, round_int8
from tests.helpers.quant_blocks import random_experts

pytestmark = pytest.mark.gpu

TOP_K, TOKENS = 8, 512
GLM = (128, 4096, 1408)  # experts, hidden, expert width
QWEN3 = (128, 2048, 768)
# bf16 rows, the rows and the activation rounded to int8 per 32: within this fraction of the
# output's scale of the float path.
REL_TOL = 3e-2


@pytest.fixture(autouse=True)
def _first_candidate_only(monkeypatch):
    """One tile candidate per kernel; test_every_candidate_tile_computes_the_same runs all."""
    from strata.engine.core.quant import expert_mmq

    for tuned in (expert_mmq._gate_up_tuned, expert_mmq._down_tuned):
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])


def _layer(types, shape):
    num_experts, hidden, inter = shape
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    return tuple(random_experts(q, num_experts, rows, cols, seed, scale=0.02)
                 for seed, (q, (rows, cols)) in enumerate(zip(types, shapes)))


def _routed(num_experts: int, hidden: int, tokens: int = TOKENS, seed: int = 0):
    """(tokens [T, H], source [T*k], offsets [E] int32, row weights [T*k]) as the engine
    sorts them; four favoured experts get several BLOCK_M tiles, some experts none."""
    from strata.engine.core.fast.moe_prefill import route_logits, sort_by_expert

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, hidden, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    logits[:, :4] += 3.0
    weights, ids = route_logits(logits, TOP_K, True, torch.bfloat16)
    order, source, offsets = sort_by_expert(ids, num_experts)
    return x, source, offsets, weights.reshape(-1).index_select(0, order)


def _old_path(x, source, offsets, row_weights, blocks) -> torch.Tensor:
    from strata.engine.core.quant import expert_grouped

    return expert_grouped.experts_mlp(x, source, offsets, row_weights, *blocks)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    error = (got.double() - expected.double()).abs().max().item()
    assert error <= rel * expected.double().abs().max().item(), (
        error, expected.double().abs().max().item())


@pytest.mark.parametrize(("types", "shape"), [
    ((QT.Q4_K, QT.Q4_K, QT.Q5_0), GLM), ((QT.Q4_K, QT.Q4_K, QT.Q8_0), GLM),
    ((QT.Q4_K, QT.Q4_K, QT.Q6_K), QWEN3)], ids=["glm-Q5_0", "glm-Q8_0", "qwen3-Q6_K"])
def test_cuda_chunk_matches_dequantize_then_grouped_mm(types, shape) -> None:
    from strata.engine.core.quant import expert_mmq

    blocks = _layer(types, shape)
    x, source, offsets, row_weights = _routed(shape[0], shape[1])
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert int(counts.max()) > expert_mmq.GATE_UP_CONFIGS[0][3]  # several tiles somewhere
    got = expert_mmq.experts_mlp(x, *blocks, offsets, row_weights, source=source)
    assert got.shape == (source.shape[0], shape[1]) and got.dtype == torch.bfloat16
    _assert_close(got, _old_path(x, source, offsets, row_weights, blocks))


# Q3_K's 256-value blocks cannot tile GLM's 1408-wide down rows (a GGUF gives such rows
# another type): its case takes Qwen3-30B-A3B's expert shape, 768 wide.
QWEN3_30B = (128, 2048, 768)


@pytest.mark.parametrize(("types", "shape"), [((QT.Q4_K, QT.Q4_K, QT.Q5_0), GLM),
                                              ((QT.Q4_K, QT.Q4_K, QT.Q3_K), QWEN3_30B)],
                         ids=["glm-Q5_0", "down-Q3_K"])
def test_cuda_int8_gate_up_then_expert_gemms_down(types, shape) -> None:
    """down_by="gemm": the int8 gate/up writes bf16 activations that expert_gemm's down
    multiplies (any type it decodes, Q3_K too, which the int8 kernels do not read):
    within the int8 rounding of the rows of the dequantize-then-GEMM path."""
    from strata.engine.core.quant import expert_mmq

    blocks = _layer(types, shape)
    x, source, offsets, row_weights = _routed(shape[0], shape[1])
    got = expert_mmq.experts_mlp(x, *blocks, offsets, row_weights, source=source,
                                 down_by="gemm")
    assert got.shape == (source.shape[0], shape[1]) and got.dtype == torch.bfloat16
    _assert_close(got, _old_path(x, source, offsets, row_weights, blocks))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1,
                                   QT.Q5_0, QT.Q5_1], ids=lambda t: t.name)
def test_cuda_products_match_torch_on_gguf_py_values_and_the_int8_rows(qtype: QT) -> None:
    from strata.engine.core.quant import expert_mmq

    num_experts, hidden, inter = 16, 1024, 512
    stack = random_experts(qtype, num_experts, hidden, inter, seed=int(qtype), scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(
        stack.raw.cpu().numpy().reshape(num_experts * hidden, -1), qtype)).view(
        num_experts, hidden, inter).double()
    x, source, offsets, _ = _routed(num_experts, inter, tokens=96, seed=int(qtype))
    rows = x.index_select(0, source).float()
    rounded = expert_mmq.quantize_rows(rows)
    # The GPU's float32 division may round 127 / max differently: a value may land one step
    # off torch's rounding; the product is checked on the kernel's own rounding.
    assert (rounded[0].cpu().int() - round_int8(rows.cpu())[0].int()).abs().max() <= 1
    got = expert_mmq.down(rounded, offsets, stack, torch.float32).cpu()
    xq = dequantized(tuple(t.cpu() for t in rounded))
    expected, begin = torch.empty_like(got, dtype=torch.float64), 0
    for expert, end in enumerate(offsets.tolist()):
        expected[begin:end] = xq[begin:end] @ dense[expert].T
        begin = end
    _assert_close(got, expected, rel=1e-5)


def test_every_candidate_tile_computes_the_same(monkeypatch) -> None:
    import triton

    from strata.engine.core.quant import expert_mmq

    shape = (16, 2048, 1408)
    blocks = _layer((QT.Q4_K, QT.Q4_K, QT.Q5_0), shape)
    x, source, offsets, row_weights = _routed(16, 2048, tokens=128)
    expected = _old_path(x, source, offsets, row_weights, blocks)
    for tuned, configs in ((expert_mmq._gate_up_tuned, expert_mmq.GATE_UP_CONFIGS),
                           (expert_mmq._down_tuned, expert_mmq.DOWN_CONFIGS)):
        for rows_n, cols, warps, extra in expert_mmq._candidates(configs):
            monkeypatch.setattr(tuned, "configs", [triton.Config(
                {"BLOCK_ROWS": rows_n, "BLOCK_COLS": cols, **extra}, num_warps=warps)])
            got = expert_mmq.experts_mlp(x, *blocks, offsets, row_weights, source=source)
            _assert_close(got, expected)


def test_cuda_graph_replays_new_routing() -> None:
    """Captured once, replayed after the routing (source, offsets, weights) changed in place:
    the offsets are read on the device, so the replay equals an eager call."""
    from strata.engine.core.quant import expert_mmq

    blocks = _layer((QT.Q4_K, QT.Q4_K, QT.Q5_0), (32, 1024, 512))
    x, source, offsets, row_weights = _routed(32, 1024, tokens=64, seed=1)
    run = lambda: expert_mmq.experts_mlp(x, *blocks, offsets, row_weights,  # noqa: E731
                                         source=source)
    run()
    graph, out = captured(run)
    new = _routed(32, 1024, tokens=64, seed=2)
    for static, fresh in zip((x, source, offsets, row_weights), new):
        static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())


TIMING_LOOP_SCRIPT = """
import sys
import torch
from gguf import GGMLQuantizationType as QT
from tests.helpers.quant_blocks import random_experts
from strata.engine.core.quant import expert_mmq

E, H, I = 128, 4096, 1408
for pair in sys.argv[1:]:
    gate_up, down_type = (QT[name] for name in pair.split("/"))
    gate, up, down = (random_experts(qtype, E, rows, cols, seed, scale=0.02)
                      for qtype, rows, cols, seed in ((gate_up, I, H, 1), (gate_up, I, H, 2),
                                                      (down_type, H, I, 3)))
    for num_rows in (8, 4096):
        rows = torch.randn(num_rows, H, dtype=torch.bfloat16, device="cuda")
        if num_rows == 8:
            offsets = torch.full((E,), 8, dtype=torch.int32, device="cuda")
        else:
            offsets = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * (num_rows // E)
        weights = torch.ones(num_rows, dtype=torch.bfloat16, device="cuda")
        out = expert_mmq.experts_mlp(rows, gate, up, down, offsets, weights)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), pair
    print("survived", pair, flush=True)
"""


def test_every_candidate_survives_the_autotuners_timing_loop(tmp_path) -> None:
    """Every tile candidate through Triton's autotuner (back-to-back timed launches) at
    GLM-4.5-Air's shape, in a subprocess with CUDA_LAUNCH_BLOCKING=1 and a fresh Triton
    cache (expert_gemm's run-18 fault showed only under this loop)."""
    env = child_env(CUDA_LAUNCH_BLOCKING="1", TRITON_CACHE_DIR=str(tmp_path))
    pairs = ("Q4_K/Q5_0",)  # GLM-4.5-Air's mix: every candidate of both kernels compiles
    done = subprocess.run([sys.executable, "-c", TIMING_LOOP_SCRIPT, *pairs], env=env,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split().count("survived") == len(pairs), done.stdout
