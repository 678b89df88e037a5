"""The fused routed-expert kernels (quant/expert_gemv.py) compiled on the GPU, in bf16: every
planes type at Qwen3-30B-A3B's expert shape against torch on gguf-py's dequantized experts,
resident and through a slot table with the rest in a pinned host copy (Q4_K, Q6_K, Q8_0 and
Q4_0 by dp4a, x and the activations in int8); dp4a against the int8-rounded reference with
experts at 2 mod 4 and every candidate tile; a CUDA graph replay with new expert ids; and a
tiny Q4_K_M-like Qwen3-MoE through the CUDA engine (graphs, partial cache) against the
dequantized model.

The CPU twin: tests/core/test_quant_expert_gemv.py (interpreter, float32).
"""

from __future__ import annotations

import itertools

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.engine.protocol import SamplingSpec
from tests.core.batch_helpers import BF16_NEAR_TIE, assert_same_or_near_tie
from tests.gpu.gpu_helpers import captured
from tests.helpers.call_counter import count_calls
from tests.helpers.quant_blocks import random_blocks

pytestmark = pytest.mark.gpu

PLANES_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
NUM_EXPERTS, HIDDEN, INTER = 16, 2048, 768
# bf16 x and act (as the grouped kernels and the model round them), float32 sums: within
# this fraction of the output's scale.
REL_TOL = 2e-2


@pytest.fixture(autouse=True)
def _first_candidate_only(monkeypatch):
    """One tile candidate per kernel: autotuning all of them for 8 types compiles ~90
    variants (minutes); the bench (bench/diag_quant_experts.py) tunes."""
    from strata.engine.core.quant import expert_gemv

    for tuned in (expert_gemv._gate_up_tuned, expert_gemv._down_sum_tuned,
                  expert_gemv._gate_up_dp4a_tuned, expert_gemv._down_sum_dp4a_tuned):
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])


def _stack(qtype: QT, rows: int, cols: int, seed: int):
    """(host blocks uint8 [E, rows * row_bytes], float32 reference [E, rows, cols] on CUDA)."""
    raw = random_blocks(qtype, NUM_EXPERTS * rows, cols, seed, scale=0.02)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).view(NUM_EXPERTS, rows, cols)
    return torch.from_numpy(raw).view(NUM_EXPERTS, -1), dense.cuda()


def _experts(qtype: QT, blocks: torch.Tensor, rows: int, cols: int, dtype=torch.bfloat16):
    from strata.engine.core.quant.experts import QuantizedExperts

    row_bytes = blocks.shape[1] // rows
    view = blocks.as_strided((blocks.shape[0], rows, row_bytes), (blocks.stride(0), row_bytes, 1))
    return QuantizedExperts(qtype, (blocks.shape[0], rows, cols), view, dtype)


def _reference(x, dense, ids, weights) -> torch.Tensor:
    gate, up, down = (d[ids] for d in dense)
    act = torch.nn.functional.silu(gate @ x.float()) * (up @ x.float())  # [k, I]
    return ((down @ act[:, :, None])[:, :, 0] * weights.float()[:, None]).sum(0)


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = (got.float() - expected).abs().max().item()
    assert error <= REL_TOL * expected.abs().max().item(), (error, expected.abs().max().item())


@pytest.mark.parametrize("qtype", PLANES_TYPES, ids=lambda t: t.name)
def test_cuda_fused_experts_resident_and_through_slots_and_pinned_host(qtype: QT) -> None:
    from strata.engine.core.quant import expert_gemv

    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    stacks = [_stack(qtype, rows, cols, seed=int(qtype) + p)
              for p, (rows, cols) in enumerate(shapes)]
    dense = [d for _, d in stacks]
    resident = [_experts(qtype, b.cuda(), *s) for (b, _), s in zip(stacks, shapes)]
    gen = torch.Generator().manual_seed(int(qtype))
    x = (torch.randn(HIDDEN, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    for k in (1, 8):
        ids = torch.randperm(NUM_EXPERTS, generator=gen)[:k].cuda()
        weights = torch.softmax(torch.randn(k, generator=gen), 0).to("cuda", torch.bfloat16)
        assert expert_gemv.supports(*resident)
        got = expert_gemv.routed_mlp(x, *resident, ids, weights)
        assert got.shape == (HIDDEN,) and got.dtype == torch.bfloat16
        _assert_close(got, _reference(x, dense, ids, weights))

    # A partial cache: 5 of 16 experts in 6 slots, the rest read in place from pinned memory
    # (under UVA a pinned tensor's device address is its host address).
    table = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    placed = {3: 0, 9: 4, 12: 1, 0: 5, 7: 2}
    slots, offsets, hosts = [], [], []  # hosts: the pinned copies stay alive while read
    for (blocks, _), shape in zip(stacks, shapes):
        host = blocks.pin_memory()
        hosts.append(host)
        slot_rows = torch.zeros(6, host.shape[1], dtype=torch.uint8, device="cuda")
        for expert, slot in placed.items():
            slot_rows[slot] = host[expert].cuda()
        slots.append(_experts(qtype, slot_rows, *shape))
        offsets.append(host.data_ptr() - slot_rows.data_ptr())
    for expert, slot in placed.items():
        table[expert] = slot
    table = table.cuda()
    ids = torch.tensor([3, 1, 9, 15, 12, 4, 0, 7], device="cuda")
    weights = torch.full((8,), 0.125, dtype=torch.bfloat16, device="cuda")
    assert expert_gemv.supports(*slots, table, tuple(offsets))
    got = expert_gemv.routed_mlp(x, *slots, ids, weights, table, tuple(offsets))
    _assert_close(got, _reference(x, dense, ids, weights))
    # The same sum in the same order as all resident: bit for bit.
    torch.testing.assert_close(got, expert_gemv.routed_mlp(x, *resident, ids, weights),
                               rtol=0, atol=0)


def test_cuda_fused_experts_replay_in_a_cuda_graph_with_new_ids() -> None:
    from strata.engine.core.quant import expert_gemv

    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    qtypes = (QT.Q4_K, QT.Q4_K, QT.Q6_K)  # Qwen3-30B-A3B Q4_K_M's expert types
    stacks = [_stack(q, rows, cols, seed=p) for p, (q, (rows, cols)) in
              enumerate(zip(qtypes, shapes))]
    experts = [_experts(q, b.cuda(), *s) for q, (b, _), s in zip(qtypes, stacks, shapes)]
    x = (torch.randn(HIDDEN, device="cuda") * 0.05).to(torch.bfloat16)
    ids = torch.arange(8, device="cuda")
    weights = torch.full((8,), 0.125, dtype=torch.bfloat16, device="cuda")
    expert_gemv.routed_mlp(x, *experts, ids, weights)  # compile and autotune outside capture
    graph, out = captured(lambda: expert_gemv.routed_mlp(x, *experts, ids, weights))
    for new_ids in ([15, 2, 7, 9, 0, 11, 4, 13], [1, 3, 5, 6, 8, 10, 12, 14]):
        ids.copy_(torch.tensor(new_ids))
        graph.replay()
        torch.cuda.synchronize()
        expected = expert_gemv.routed_mlp(x, *experts, ids, weights)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        _assert_close(out, _reference(x, [d for _, d in stacks], ids, weights))


DP4A_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
              QT.IQ2_XXS]


def _int8_rounded(v: torch.Tensor) -> torch.Tensor:
    from strata.engine.core.quant import gemv_dp4a

    q, d, _ = gemv_dp4a.quantize_x(v)
    return (q.float().view(v.shape[0], -1, 32) * d[:, :, None]).view(v.shape)


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_cuda_dp4a_experts_equal_the_int8_rounded_reference_for_every_tile(
        qtype: QT, monkeypatch) -> None:
    """Real dp4a and funnel shifts at Qwen3-30B-A3B's shape, experts 2 bytes apart beyond
    their blocks (Q6_K, Q8_0, Q4_0, Q5_0: every other expert at 2 mod 4; Q4_K 4): gate_up against x as
    quantize_x rounds it, down_sum against the kernel's activations so rounded, with each
    candidate tile (not just the first) and through a slot table over pinned host blocks."""
    import triton

    from strata.engine.core.quant import expert_gemv
    from strata.engine.core.quant.experts import QuantizedExperts

    pad = 4 if qtype in (QT.Q4_K, QT.Q5_K) else 2
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    host, dense, resident = [], [], []
    for p, (rows, cols) in enumerate(shapes):
        blocks, reference = _stack(qtype, rows, cols, seed=40 + p)
        padded = torch.zeros(NUM_EXPERTS, blocks.shape[1] + pad, dtype=torch.uint8)
        padded[:, : blocks.shape[1]] = blocks
        host.append(padded.pin_memory())
        dense.append(reference)
        row_bytes = blocks.shape[1] // rows
        view = padded.cuda().as_strided((NUM_EXPERTS, rows, row_bytes),
                                        (padded.shape[1], row_bytes, 1))
        resident.append(QuantizedExperts(qtype, (NUM_EXPERTS, rows, cols), view,
                                         torch.bfloat16))
    x = (torch.randn(HIDDEN, device="cuda") * 0.05).to(torch.bfloat16)
    ids = torch.tensor([3, 1, 9, 15, 12, 4, 0, 7], device="cuda")
    weights = torch.softmax(torch.randn(8, device="cuda"), 0).to(torch.bfloat16)
    assert all(expert_gemv.uses_dp4a(w, x) for w in resident)
    rounded = _int8_rounded(x[None])[0]
    g = torch.einsum("kih,h->ki", dense[0][ids], rounded)
    u = torch.einsum("kih,h->ki", dense[1][ids], rounded)
    act_expected = torch.nn.functional.silu(g) * u
    def config(rows, cols, warps, stages):
        return triton.Config({"BLOCK_ROWS": rows, "BLOCK_COLS": cols, "STAGES": stages},
                             num_warps=warps)

    iq2 = qtype == QT.IQ2_XXS  # whole-block groups: its own tiles and tuners
    gate_up_tiles = (expert_gemv.GATE_UP_IQ2_CONFIGS if iq2
                     else expert_gemv.GATE_UP_DP4A_CONFIGS)
    down_tiles = expert_gemv.DOWN_SUM_IQ2_CONFIGS if iq2 else expert_gemv.DOWN_SUM_DP4A_CONFIGS
    gate_up_tuned = expert_gemv._gate_up_iq2_tuned if iq2 else expert_gemv._gate_up_dp4a_tuned
    down_tuned = expert_gemv._down_sum_iq2_tuned if iq2 else expert_gemv._down_sum_dp4a_tuned
    for tile_gate_up, tile_down in itertools.zip_longest(gate_up_tiles, down_tiles,
                                                         fillvalue=None):
        tile_gate_up, tile_down = tile_gate_up or gate_up_tiles[0], tile_down or down_tiles[0]
        monkeypatch.setattr(gate_up_tuned, "configs", [config(*tile_gate_up)])
        monkeypatch.setattr(down_tuned, "configs", [config(*tile_down)])
        act = expert_gemv.gate_up(x, resident[0], resident[1], ids)
        _assert_close(act, act_expected)
        y = expert_gemv.down_sum(act, resident[2], ids, weights)
        y_expected = (torch.einsum("khi,ki->kh", dense[2][ids], _int8_rounded(act))
                      * weights.float()[:, None]).sum(0)
        _assert_close(y, y_expected)
    # Through the table: 3 experts in slots, the rest read in place from pinned memory.
    table = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    placed = {3: 0, 12: 2, 7: 1}
    slots, offsets = [], []
    for blocks, w in zip(host, resident):
        slot_rows = torch.zeros(4, blocks.shape[1], dtype=torch.uint8, device="cuda")
        for expert, slot in placed.items():
            slot_rows[slot] = blocks[expert].cuda()
        _, rows, row_bytes = w.raw.shape
        view = slot_rows.as_strided((4, rows, row_bytes), (blocks.shape[1], row_bytes, 1))
        slots.append(QuantizedExperts(qtype, (4, *w.shape[1:]), view, torch.bfloat16))
        offsets.append(blocks.data_ptr() - slot_rows.data_ptr())
    for expert, slot in placed.items():
        table[expert] = slot
    table = table.cuda()
    assert expert_gemv.supports(*slots, table, tuple(offsets))
    got = expert_gemv.routed_mlp(x, *slots, ids, weights, table, tuple(offsets))
    torch.testing.assert_close(got, expert_gemv.routed_mlp(x, *resident, ids, weights),
                               rtol=0, atol=0)  # the same sums in the same order
    monkeypatch.setenv("STRATA_DP4A", "0")  # planes, from the same blocks: within int8's cost
    _assert_close(expert_gemv.routed_mlp(x, *resident, ids, weights), got.float())


# Both layers' experts the same size (Q4_0 stores 256 values in Q4_K's 144 bytes), so one
# slot class holds them and 10 slots make a partial cache (two classes would each need a
# layer's 8 experts: all 16).
PLANES_MIX = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "Q4_K",
              "blk.0.ffn_up_exps.weight": "Q4_K", "blk.1.ffn_up_exps.weight": "Q4_0",
              "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q6_K"}


@pytest.mark.parametrize("expert_cache", ["auto", "10"])
def test_cuda_engine_decodes_through_the_fused_kernels(tmp_path, monkeypatch,
                                                       expert_cache) -> None:
    """A tiny Q4_K_M-like Qwen3-MoE (2 x 8 experts; 10 slots: misses from pinned host) in
    CUDA graphs: tokens equal the dequantized model's or part at a bf16 near-tie."""
    import transformers

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.quant import expert_gemv
    from tests.helpers.gguf_writer import write_gguf_from_hf
    from tests.helpers.tiny_models import make_tiny_hf_config

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = write_gguf_from_hf(model, None, tmp_path / "moe.gguf", "Q8_0",
                              qtype_overrides=PLANES_MIX)
    calls = count_calls(monkeypatch, expert_gemv, "routed_mlp")
    prompt = [(7 * i + 3) % 300 for i in range(40)]
    spec = SamplingSpec(max_tokens=24, temperature=0.0)

    def load(quantized: bool) -> Engine:
        monkeypatch.setenv("STRATA_QUANTIZED", "1" if quantized else "0")
        engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256,
                                     expert_cache=expert_cache))
        engine.load()
        return engine

    reference = load(quantized=False)
    try:
        expected = [t for step in reference.generate(prompt, spec) for t in step]
        engine = load(quantized=True)
        try:
            assert engine.fast is not None
            got = [t for step in engine.generate(prompt, spec) for t in step]
        finally:
            engine.close()
        assert calls[0] > 0
        if got != expected:
            assert_same_or_near_tie(reference, prompt, expected, got, BF16_NEAR_TIE)
    finally:
        reference.close()
