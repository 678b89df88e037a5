"""The batched quantized expert kernels (quant/expert_batch.py) compiled on the GPU, in bf16:
Qwen3-30B-A3B's expert shape (128 experts of 768 x 2048, top 8) in Q4_K_M's types, B = 2, 4,
8 and 16 rows routed by moe_batch's router, against the one-token kernels row by row and
torch on the dequantized experts; a partial cache (slots and pinned host) bit for bit equal
to all resident; a CUDA graph replay with new rows (new routing) equal to the eager call; a
tiny Q4_K_M-like Qwen3-MoE whose batches replay from graphs (resident and partial cache)
and give each sequence its tokens alone. Times nothing (bench/diag_quant_batch.py does).

The CPU twins: tests/core/test_quant_expert_batch.py, test_quant_batch_decode.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from strata.engine.protocol import SamplingSpec
from tests.core.batch_helpers import alone, assert_same_or_near_tie, run_batch
from tests.gpu.gpu_helpers import captured
from tests.helpers.quant_blocks import random_blocks

pytestmark = pytest.mark.gpu

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
SHAPES = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))  # gate, up, down: [N, K]
# bf16 x, act and (for tl.dot) weights, float32 sums: within this fraction of the output's
# scale.
REL_TOL = 2e-2
# Of the largest logit, as test_batch_graph_cuda.py: the batch rounds the expert weights to
# bf16 for tl.dot, a sequence alone multiplies them in float32.
BF16_NEAR_TIE = 3e-2


@pytest.fixture(autouse=True)
def _first_candidate_only(monkeypatch):
    """One tile candidate per kernel (autotuning every type's candidates compiles dozens of
    variants); bench/diag_quant_batch.py tunes."""
    from strata.engine.core.quant import expert_batch, expert_gemv

    for tuned in (expert_batch._gate_up_tuned, expert_batch._down_tuned,
                  expert_gemv._gate_up_tuned, expert_gemv._down_sum_tuned):
        monkeypatch.setattr(tuned, "configs", tuned.configs[:1])


def _blocks(qtypes, seed: int) -> list[torch.Tensor]:
    """Host uint8 [E, rows * row_bytes] per projection: random valid blocks."""
    return [torch.from_numpy(random_blocks(q, NUM_EXPERTS * rows, cols, seed + p,
                                           scale=0.02)).view(NUM_EXPERTS, -1)
            for p, (q, (rows, cols)) in enumerate(zip(qtypes, SHAPES))]


def _experts(qtype: QT, blocks: torch.Tensor, shape: tuple[int, int]):
    from strata.engine.core.quant.experts import QuantizedExperts

    rows, cols = shape
    row_bytes = blocks.shape[1] // rows
    view = blocks.as_strided((blocks.shape[0], rows, row_bytes), (blocks.stride(0), row_bytes, 1))
    return QuantizedExperts(qtype, (blocks.shape[0], rows, cols), view, torch.bfloat16)


def _reference(x, experts, ids, weights) -> torch.Tensor:
    """float32 row by row on Strata's dequantizer (bit for bit gguf-py's), one expert at a
    time: [T, H]."""
    gate, up, down = experts
    out = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    for b in range(x.shape[0]):
        xb = x[b].float()
        for j, e in enumerate(ids[b].tolist()):
            g = gate.expert(e).dequantize().float() @ xb
            u = up.expert(e).dequantize().float() @ xb
            act = (torch.nn.functional.silu(g) * u).to(torch.bfloat16).float()
            out[b] += float(weights[b, j]) * (down.expert(e).dequantize().float() @ act)
    return out


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    error = (got.float() - expected.float()).abs().max().item()
    assert error <= REL_TOL * expected.float().abs().max().item(), (
        error, expected.float().abs().max().item())


def _rows(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, H] bf16, router [E, H] bf16); rows past the middle repeat row 0 like padding."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(num_rows, HIDDEN, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    if num_rows > 2:
        x[num_rows // 2 :: 3] = x[0]
    router = (torch.randn(NUM_EXPERTS, HIDDEN, generator=g, device="cuda") * 0.5).to(
        torch.bfloat16)
    return x, router


@pytest.mark.parametrize("down_type", [QT.Q6_K, QT.Q4_K], ids=lambda t: t.name)
def test_cuda_batched_experts_match_the_one_token_kernels_and_torch(down_type: QT) -> None:
    from strata.engine.core.fast import moe_batch
    from strata.engine.core.quant import expert_batch, expert_gemv

    qtypes = (QT.Q4_K, QT.Q4_K, down_type)  # Q4_K_M's expert layers
    experts = [_experts(q, b.cuda(), s) for q, b, s in zip(qtypes, _blocks(qtypes, 1), SHAPES)]
    assert expert_batch.supports(*experts)
    for num_rows in (2, 4, 8, 16):
        x, router = _rows(num_rows, seed=num_rows)
        weights, ids = moe_batch.router_topk_rows(x, router, TOP_K, True)
        got = expert_batch.routed_rows(x, *experts, ids, weights)
        assert got.shape == (num_rows, HIDDEN) and got.dtype == torch.bfloat16
        one = torch.stack([expert_gemv.routed_mlp(x[b], *experts, ids[b], weights[b])
                           for b in range(num_rows)])
        _assert_close(got, one)
        checked = [0, num_rows - 1]  # the float32 reference costs a dequantize per expert
        _assert_close(got[checked], _reference(x[checked], experts, ids[checked],
                                               weights[checked]))


def test_cuda_batched_experts_through_slots_and_pinned_host_equal_all_resident() -> None:
    """A partial cache: 12 of 128 experts in 16 slots, the rest read in place from pinned
    memory (under UVA a pinned tensor's device address is its host address)."""
    from strata.engine.core.fast import moe_batch
    from strata.engine.core.quant import expert_batch

    qtypes = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
    blocks = _blocks(qtypes, 2)
    resident = [_experts(q, b.cuda(), s) for q, b, s in zip(qtypes, blocks, SHAPES)]
    x, router = _rows(8, seed=3)
    weights, ids = moe_batch.router_topk_rows(x, router, TOP_K, True)
    routed = list(dict.fromkeys(ids.flatten().tolist()))
    placed = {e: slot for slot, e in enumerate(routed[::2][:12])}  # every other one resident
    table = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    slots, offsets, hosts = [], [], []  # hosts: the pinned copies stay alive while read
    for q, b, shape in zip(qtypes, blocks, SHAPES):
        host = b.pin_memory()
        hosts.append(host)
        slot_rows = torch.full((16, host.shape[1]), 0x55, dtype=torch.uint8, device="cuda")
        for expert, slot in placed.items():
            slot_rows[slot] = host[expert].cuda()
        slots.append(_experts(q, slot_rows, shape))
        offsets.append(host.data_ptr() - slot_rows.data_ptr())
    for expert, slot in placed.items():
        table[expert] = slot
    table = table.cuda()
    assert expert_batch.supports(*slots, table, tuple(offsets))
    got = expert_batch.routed_rows(x, *slots, ids, weights, table, tuple(offsets))
    # The same tiles, the same sums in the same order as all resident: bit for bit.
    torch.testing.assert_close(got, expert_batch.routed_rows(x, *resident, ids, weights),
                               rtol=0, atol=0)


def test_cuda_batched_experts_replay_in_a_cuda_graph_with_new_routing() -> None:
    """Router and experts captured once for 16 rows, replayed on new rows: the routing
    changes, the result equals the eager call's bit for bit."""
    from strata.engine.core.fast import moe_batch
    from strata.engine.core.quant import expert_batch

    qtypes = (QT.Q4_K, QT.Q4_K, QT.Q6_K)
    experts = [_experts(q, b.cuda(), s) for q, b, s in zip(qtypes, _blocks(qtypes, 4), SHAPES)]
    x, router = _rows(16, seed=5)
    static_x = x.clone()

    def block(rows):
        weights, ids = moe_batch.router_topk_rows(rows, router, TOP_K, True)
        return expert_batch.routed_rows(rows, *experts, ids, weights), ids

    block(static_x)  # compile and autotune outside the capture
    graph, (static_out, static_ids) = captured(lambda: block(static_x))
    first_ids = None
    for seed in (6, 7):
        new_x, _ = _rows(16, seed=seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        expected, ids = block(new_x)
        assert torch.equal(static_ids, ids)
        torch.testing.assert_close(static_out, expected, rtol=0, atol=0)
        if first_ids is None:
            first_ids = ids.clone()
    assert not torch.equal(first_ids, static_ids)  # the replays routed differently


PLANES_MIX = {"blk.0.ffn_gate_exps.weight": "Q4_K", "blk.1.ffn_gate_exps.weight": "Q4_K",
              "blk.0.ffn_up_exps.weight": "Q4_K", "blk.1.ffn_up_exps.weight": "Q4_K",
              "blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q4_K"}
# One slot class: each class needs slots for all of its layers' experts (a prefill chunk can
# route to every one), so PLANES_MIX's two one-layer classes leave no partial cache.
ONE_CLASS_MIX = {**PLANES_MIX, "blk.1.ffn_down_exps.weight": "Q6_K"}


@pytest.mark.parametrize("expert_cache", ["auto", "10"])
def test_cuda_engine_batches_quantized_experts_in_graphs(tmp_path, monkeypatch,
                                                         expert_cache) -> None:
    """A tiny Q4_K_M-like Qwen3-MoE (2 x 8 experts; 10 slots of one class: misses from
    pinned host): batches of 3 and 4 replay graphs through the batched kernels, and each
    sequence gets its tokens alone, or parts at a bf16 near-tie."""
    import transformers

    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.core.quant import expert_batch
    from tests.helpers.gguf_writer import write_gguf_from_hf
    from tests.helpers.tiny_models import make_tiny_hf_config

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = config.intermediate_size = config.moe_intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = write_gguf_from_hf(model, None, tmp_path / "moe.gguf", "Q8_0",
                              qtype_overrides=PLANES_MIX if expert_cache == "auto"
                              else ONE_CLASS_MIX)
    from strata.engine.core.fast import batch_experts

    monkeypatch.setattr(batch_experts, "QUANT_BATCHED_MIN_ROWS", 2)  # these batches are 3 and 4
    calls: list[int] = []
    batched = expert_batch.routed_rows

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return batched(x, *args, **kwargs)

    monkeypatch.setattr(expert_batch, "routed_rows", counted)
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", context_tokens=256,
                                 num_slots=4, expert_cache=expert_cache,
                                 prefill_chunk_tokens=16))
    engine.load()
    try:
        assert engine.memory.expert_mode == ("all" if expert_cache == "auto" else "slots")
        assert engine._runner.batch is not None, "quantized batches should replay graphs"
        for num in (3, 4):
            chats = [[(7 * i + 3 * j + num) % 300 + 5 for j in range(6 + 11 * i)]
                     for i in range(num)]
            specs = [SamplingSpec(max_tokens=12 + 3 * i) for i in range(num)]
            expected = [alone(engine, p, s, i) for i, (p, s) in enumerate(zip(chats, specs))]
            got = run_batch(engine, {f"r{i}": (p, s, None)
                                     for i, (p, s) in enumerate(zip(chats, specs))})
            for i, prompt in enumerate(chats):
                assert_same_or_near_tie(engine, prompt, expected[i], got.tokens[f"r{i}"],
                                        BF16_NEAR_TIE)
            for slot in range(4):
                engine.erase_slot(slot)
        # Captured once per bucket (warm-up and capture), then replayed without a call.
        assert calls, "no batch step went through the batched quantized kernels"
        assert {key[0] for key in engine._runner.batch.graphs} & {2, 4}
    finally:
        engine.close()
