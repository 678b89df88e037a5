"""The grouped GEMMs over quantized experts (quant/expert_gemm.py) compiled on the GPU, in bf16:
a 512-token chunk at Qwen3-30B-A3B's expert shape (E=128, H=2048, I=768, k=8) against the
other prefill path (experts dequantized in groups, then torch._grouped_mm); every tile
candidate the autotuner may pick; a smaller layer against torch on gguf-py's dequantized
experts per type; a CUDA graph replayed with new routing; and a tiny quantized Qwen3-MoE's
prefill logits through the engine path against the old path.

The CPU twin: tests/core/test_quant_expert_gemm.py (interpreter, float32).
"""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from tests.gpu.gpu_helpers import captured
from tests.helpers.call_counter import count_calls
from tests.helpers.child_env import child_env
from tests.helpers.quant_blocks import random_experts

pytestmark = pytest.mark.gpu

NUM_EXPERTS, HIDDEN, INTER, TOP_K, TOKENS = 128, 2048, 768, 8, 512
Q4_K_M = (QT.Q4_K, QT.Q4_K, QT.Q6_K)  # Qwen3-30B-A3B Q4_K_M's expert types (gate, up, down)
# bf16 rows, weights and activations rounded alike, float32 sums in another order: within
# this fraction of the output's scale.
REL_TOL = 2e-2


@pytest.fixture(autouse=True)
def _first_candidate_only(monkeypatch):
    """One tile candidate per kernel (the engine autotunes over all of them: minutes of
    compiles per type); test_every_candidate_tile_computes_the_same runs each one."""
    from strata.engine.core.quant import expert_gemm

    for tuned in (expert_gemm._gate_up_tuned, expert_gemm._down_tuned):
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])


def _random_stack(qtype: QT, num_experts: int, rows: int, cols: int, seed: int,
                  with_reference: bool = False):
    """(QuantizedExperts [E, rows, cols] in bf16 on CUDA, float32 reference or None)."""
    stack = random_experts(qtype, num_experts, rows, cols, seed, scale=0.02)
    reference = None
    if with_reference:
        raw = stack.raw.cpu().numpy().reshape(num_experts * rows, -1)
        reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(
            num_experts, rows, cols).cuda()
    return stack, reference


def _layer(types, num_experts: int = NUM_EXPERTS, with_reference: bool = False):
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    made = [_random_stack(q, num_experts, rows, cols, seed=p, with_reference=with_reference)
            for p, (q, (rows, cols)) in enumerate(zip(types, shapes))]
    return tuple(m[0] for m in made), tuple(m[1] for m in made)


def _routed(num_experts: int, tokens: int = TOKENS, seed: int = 0):
    """(rows [T*k, H], offsets [E] int32, row weights [T*k]) as the engine sorts them. Four
    experts are favoured (most tokens pick them: several BLOCK_M tiles each), the rest
    spread at random (some get no rows)."""
    from strata.engine.core.fast.moe_prefill import _sorted_rows, route_logits

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, HIDDEN, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    logits = torch.randn(tokens, num_experts, device="cuda", generator=gen)
    logits[:, :4] += 3.0
    weights, ids = route_logits(logits, TOP_K, True, torch.bfloat16)
    _, offsets, rows, row_weights = _sorted_rows(x, weights, ids, num_experts)
    return rows, offsets, row_weights


def _old_path(rows, offsets, row_weights, blocks) -> torch.Tensor:
    """The dequantize-then-grouped-GEMM path (quant/expert_grouped.py) over the same rows."""
    from strata.engine.core.quant import expert_grouped

    source = torch.arange(rows.shape[0], device=rows.device)
    return expert_grouped.experts_mlp(rows, source, offsets, row_weights, *blocks)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, rel: float = REL_TOL) -> None:
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= rel * expected.float().abs().max().item(), (
        error, expected.float().abs().max().item())


@pytest.mark.parametrize("types", [Q4_K_M, (QT.Q8_0,) * 3, (QT.IQ4_XS, QT.IQ4_XS, QT.Q5_K)],
                         ids=["Q4_K_M", "Q8_0", "IQ4_XS-Q5_K"])
def test_cuda_chunk_at_qwen3_30b_a3b_shape_matches_dequantize_then_grouped_mm(types) -> None:
    from strata.engine.core.quant import expert_gemm

    blocks, _ = _layer(types)
    rows, offsets, row_weights = _routed(NUM_EXPERTS)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert int(counts.max()) > expert_gemm.GATE_UP_CONFIGS[0][3]  # several tiles somewhere
    got = expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)
    assert got.shape == rows.shape and got.dtype == torch.bfloat16
    _assert_close(got, _old_path(rows, offsets, row_weights, blocks))


def test_cuda_experts_without_rows_and_an_empty_chunk() -> None:
    """Every row on 3 of 128 experts (125 experts without rows: surplus programs exit)."""
    from strata.engine.core.quant import expert_gemm

    blocks, _ = _layer(Q4_K_M)
    rows, _, row_weights = _routed(NUM_EXPERTS, tokens=64)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int32, device="cuda")
    counts[[5, 6, 127]] = torch.tensor([300, 1, rows.shape[0] - 301], dtype=torch.int32,
                                       device="cuda")
    offsets = counts.cumsum(0).to(torch.int32)
    got = expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)
    _assert_close(got, _old_path(rows, offsets, row_weights, blocks))
    empty = expert_gemm.experts_mlp(rows[:0], *blocks, torch.zeros_like(offsets),
                                    row_weights[:0])
    assert empty.shape == (0, HIDDEN)


def test_every_candidate_tile_computes_the_same(monkeypatch) -> None:
    """Each tile candidate the autotuner may choose, compiled and run on its own."""
    import triton

    from strata.engine.core.quant import expert_gemm

    blocks, _ = _layer(Q4_K_M, num_experts=16)
    rows, offsets, row_weights = _routed(16, tokens=128)
    expected = _old_path(rows, offsets, row_weights, blocks)
    for tuned, configs in ((expert_gemm._gate_up_tuned, expert_gemm.GATE_UP_CONFIGS),
                           (expert_gemm._down_tuned, expert_gemm.DOWN_CONFIGS)):
        for rows_n, cols, warps, extra in expert_gemm._candidates(configs):
            monkeypatch.setattr(tuned, "configs", [triton.Config(
                {"BLOCK_ROWS": rows_n, "BLOCK_COLS": cols, **extra}, num_warps=warps)])
            got = expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)
            _assert_close(got, expected)


TIMING_LOOP_SCRIPT = """
import sys
import torch
from gguf import GGMLQuantizationType as QT
from tests.helpers.quant_blocks import random_experts
from strata.engine.core.quant import expert_gemm

E, H, I = 128, 2048, 768
for name in sys.argv[1:]:
    qtype = QT[name]
    gate, up, down = (random_experts(qtype, E, rows, cols, seed, scale=0.02)
                      for rows, cols, seed in ((I, H, 1), (I, H, 2), (H, I, 3)))
    for num_rows in (8, 4096):  # the load's warm-up (all on expert 0), a 512-token chunk
        rows = torch.randn(num_rows, H, dtype=torch.bfloat16, device="cuda")
        if num_rows == 8:
            offsets = torch.full((E,), 8, dtype=torch.int32, device="cuda")
        else:
            offsets = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * (num_rows // E)
        weights = torch.ones(num_rows, dtype=torch.bfloat16, device="cuda")
        out = expert_gemm.experts_mlp(rows, gate, up, down, offsets, weights)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all()), name
    print("survived", name, flush=True)
"""


def test_every_candidate_survives_the_autotuners_timing_loop(tmp_path) -> None:
    """Every tile candidate through Triton's autotuner, as the engine's load runs it: each
    timed by repeated back-to-back launches, at Qwen3-30B-A3B's expert shape, for a planes
    type of each layout (IQ2_XXS's through the lookup table) and a dequant_tile one. Run 18:
    a 32-output tile there faulted with an illegal shared-memory read under this loop only
    (once per launch it ran clean), and the IQ2_XXS file's load died of it. A fresh Triton
    cache, so nothing comes from an earlier pick; a subprocess with CUDA_LAUNCH_BLOCKING=1,
    so a fault names its kernel and leaves this process's context alone."""
    env = child_env(CUDA_LAUNCH_BLOCKING="1", TRITON_CACHE_DIR=str(tmp_path))
    types = ("Q2_K", "Q6_K", "IQ2_XXS", "IQ4_XS")
    done = subprocess.run([sys.executable, "-c", TIMING_LOOP_SCRIPT, *types], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split().count("survived") == len(types), done.stdout


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.IQ4_XS, QT.IQ2_XXS],
                         ids=lambda t: t.name)
def test_cuda_grouped_gemm_matches_torch_on_gguf_py_values(qtype: QT) -> None:
    from strata.engine.core.quant import expert_gemm

    blocks, dense = _layer((qtype,) * 3, num_experts=16, with_reference=True)
    rows, offsets, row_weights = _routed(16, tokens=96, seed=int(qtype))
    got = expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)
    gate, up, down = dense
    expected = torch.empty(rows.shape, dtype=torch.float32, device="cuda")
    begin = 0
    for expert, end in enumerate(offsets.tolist()):
        x = rows[begin:end].float()
        act = F.silu(x @ gate[expert].T) * (x @ up[expert].T) * row_weights[begin:end,
                                                                            None].float()
        expected[begin:end] = act @ down[expert].T
        begin = end
    _assert_close(got, expected)


def test_cuda_graph_replays_with_new_routing() -> None:
    """Offsets, rows and weights in fixed buffers: a captured chunk replayed with another
    routing equals an eager call (the schedule is worked out on the device)."""
    from strata.engine.core.quant import expert_gemm

    blocks, _ = _layer(Q4_K_M)
    rows, offsets, row_weights = _routed(NUM_EXPERTS, tokens=128, seed=1)
    expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)  # compile outside capture
    graph, out = captured(lambda: expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights))
    for seed in (2, 3):
        new_rows, new_offsets, new_weights = _routed(NUM_EXPERTS, tokens=128, seed=seed)
        rows.copy_(new_rows)
        offsets.copy_(new_offsets)
        row_weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        expected = expert_gemm.experts_mlp(rows, *blocks, offsets, row_weights)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


PLANES_MIX = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "IQ4_XS",
              "blk.0.ffn_up_exps.weight": "Q4_K", "blk.1.ffn_up_exps.weight": "Q5_K",
              "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q5_0"}


def test_cuda_engine_prefill_matches_the_dequantizing_path(tmp_path, monkeypatch) -> None:
    """A tiny Qwen3-MoE, Q4_K_M-like with one I-quant, all experts resident: a 40-token
    prompt in chunks of 16 takes the grouped kernels; its logits equal the old path's
    within bf16 rounding."""
    import transformers

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.fast import moe_prefill
    from strata.engine.core.fast.prefill import prefill
    from strata.engine.core.kv_cache import KVCache
    from strata.engine.core.quant import expert_gemm
    from tests.helpers.gguf_writer import write_gguf_from_hf
    from tests.helpers.tiny_models import make_tiny_hf_config

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = write_gguf_from_hf(model, None, tmp_path / "moe.gguf", "Q8_0",
                              qtype_overrides=PLANES_MIX)
    calls = count_calls(monkeypatch, expert_gemm, "experts_mlp")
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256))
    engine.load()
    try:
        assert engine.memory.expert_mode == "all"
        ids = torch.tensor([(7 * i + 3) % 300 for i in range(40)], device="cuda")

        def logits() -> torch.Tensor:
            kv = KVCache.for_config(engine.model.config, 64, torch.bfloat16,
                                    torch.device("cuda"))
            return prefill(engine.model, kv, ids, 0, chunk_tokens=16, moe_impl="triton")

        calls[0] = 0  # the load's warm-up ran them once
        got = logits()
        assert calls[0] > 0
        monkeypatch.setattr(moe_prefill, "decodes_in_gemm", lambda *experts: False)
        expected = logits()
        _assert_close(got, expected, rel=3e-2)
    finally:
        engine.close()
