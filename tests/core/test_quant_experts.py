"""Quantized MoE experts (quant/experts.py) through the Triton CPU interpreter: the gather
dequantizer equals gguf-py on padded and slot-table layouts, and tiny Qwen3-MoE / Mixtral GGUF
files keep their expert blocks in the store's slots and host copy, decode greedily exactly
like the dequantized path (reference loop, fast schedule, partial cache), and survive
release, refill and shrink. tests/gpu/test_quant_experts_cuda.py repeats the engine part
on the GPU.
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
import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.protocol import SamplingSpec
from tests.helpers.call_counter import count_calls
from tests.helpers.dp4a_switch import assert_dp4a_matches_planes
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.quant_blocks import (
    K_AND_I_MIX,
    MIXED_LAYERS,
    alternating_mix,
    random_blocks,
)
from tests.helpers.tiny_models import make_tiny_hf_config

PROMPT = [(7 * i + 3) % 300 for i in range(23)]  # > 16 tokens: the grouped prefill
NUM_NEW = 6  # each interpreted decode step costs CI seconds
E, ROWS, COLS = 5, 8, 512


def _stack(qtype: QT, seed: int, pad_bytes: int = 0):
    """(QuantizedExperts [E, ROWS, COLS] whose experts lie pad_bytes apart beyond their
    blocks, the dequantized float32 reference [E, ROWS, COLS])."""
    raw = random_blocks(qtype, E * ROWS, COLS, seed)
    expected = gguf.quants.dequantize(raw, qtype).reshape(E, ROWS, COLS)
    blocks = torch.from_numpy(raw).view(E, -1)
    padded = torch.zeros(E, blocks.shape[1] + pad_bytes, dtype=torch.uint8)
    padded[:, : blocks.shape[1]] = blocks
    row_bytes = raw.shape[1]
    view = padded.as_strided((E, ROWS, row_bytes), (padded.stride(0), row_bytes, 1))
    return QuantizedExperts(qtype, (E, ROWS, COLS), view, torch.float32), expected


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K, QT.Q6_K, QT.IQ2_XXS, QT.IQ3_S, QT.IQ1_M],
                         ids=lambda t: t.name)
def test_gather_dequantize_equals_gguf_py_through_padding(qtype: QT) -> None:
    from strata.engine.core.quant.dequant import dequantize_experts
    from strata.engine.core.quant.expert_kernels import gather_dequantize

    experts, expected = _stack(qtype, seed=int(qtype), pad_bytes=74)  # padding stays unread
    ids = torch.tensor([3, 0, 3, 4])
    got = gather_dequantize(experts, ids)
    np.testing.assert_array_equal(got.numpy(), expected[[3, 0, 3, 4]])
    whole = torch.empty(experts.shape, dtype=torch.float32)
    np.testing.assert_array_equal(dequantize_experts(experts, 0, whole).numpy(), expected)


def test_gather_dequantize_reads_slots_or_the_host_copy_through_the_table() -> None:
    """A partial cache: resident experts from their slots, the rest from the host copy."""
    from strata.engine.core.quant.expert_kernels import gather_dequantize

    host, expected = _stack(QT.Q4_K, seed=1, pad_bytes=0)
    slot_rows = torch.full((3, host.expert_stride), 0x55, dtype=torch.uint8)  # garbage slots
    table = torch.full((E,), -1, dtype=torch.int32)
    for slot, expert in ((2, 4), (0, 1)):
        table[expert] = slot
        slot_rows[slot] = host.raw[expert].reshape(-1)
    row_bytes = host.raw.shape[2]
    slots = QuantizedExperts(QT.Q4_K, (3, ROWS, COLS), slot_rows.as_strided(
        (3, ROWS, row_bytes), (slot_rows.stride(0), row_bytes, 1)), torch.float32)
    offset = host.raw.data_ptr() - slot_rows.data_ptr()
    ids = torch.tensor([4, 2, 1, 0])
    got = gather_dequantize(slots, ids, table, offset)
    np.testing.assert_array_equal(got.numpy(), expected[[4, 2, 1, 0]])


# ---- engine -------------------------------------------------------------------------------

MIXED = K_AND_I_MIX  # two slot classes of two layers


def _gguf(tmp_path, variant: str, qtype: str, overrides=None, wide: bool = False):
    import transformers

    config = make_tiny_hf_config(variant)
    if overrides and any(f"blk.{MIXED_LAYERS - 1}." in name for name in overrides):
        config.num_hidden_layers = MIXED_LAYERS  # MIXED, PLANES_MIX
    if wide:  # rows of 256 values: K- and I-quant blocks
        config.hidden_size = 256
        config.moe_intermediate_size = config.intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return write_gguf_from_hf(model, None, tmp_path / f"{variant}.gguf", qtype,
                              qtype_overrides=overrides)


def _engine(path, monkeypatch, quantized: bool, expert_cache: str = "auto") -> Engine:
    monkeypatch.setenv("STRATA_QUANTIZED", "1" if quantized else "0")
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=64,
                                 expert_cache=expert_cache, snapshot_ram_budget_bytes=1 << 20))
    engine.load()
    return engine


def _greedy(engine: Engine) -> list[int]:
    spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
    return [t for step in engine.generate(PROMPT, spec) for t in step]


def _reference(path, monkeypatch) -> tuple[list[int], int]:
    engine = _engine(path, monkeypatch, quantized=False)
    try:
        return _greedy(engine), engine.memory.experts.bytes_per_expert
    finally:
        engine.close()


def _expert_block_bytes(path) -> dict[int, list[int]]:
    """layer -> bytes of one expert's gate, up, down blocks, as the file stores them."""
    out: dict[int, list[int]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            proj = ("gate", "up", "down").index(t.name.split(".")[2].split("_")[1])
            out.setdefault(layer, [0, 0, 0])[proj] = int(t.n_bytes) // int(t.shape[-1])
    return out


@pytest.mark.parametrize(("variant", "qtype", "overrides", "wide"), [
    ("qwen3_moe", "Q8_0", None, False),
    ("mixtral", "Q4_0", None, False),
    ("qwen3_moe", "Q8_0", MIXED, True),
], ids=["qwen3_moe-Q8_0", "mixtral-Q4_0", "qwen3_moe-mixed-K-and-I-quants"])
def test_quantized_experts_keep_their_blocks_and_decode_like_the_dequantized_path(
        tmp_path, monkeypatch, variant, qtype, overrides, wide) -> None:
    path = _gguf(tmp_path, variant, qtype, overrides, wide)
    expected, float_bytes = _reference(path, monkeypatch)
    per_layer = _expert_block_bytes(path)
    for cache in ("auto", str(len(per_layer) * 8 // 2 if variant == "qwen3_moe" else 4)):
        engine = _engine(path, monkeypatch, quantized=True, expert_cache=cache)
        try:
            store = engine.memory.experts
            assert store.is_quantized
            # Blocks as stored, each layer's at its own size: the host copy and every slot
            # hold exactly that, nothing in float and no padding to a larger layer's type.
            assert len(store.classes) == len({tuple(sizes) for sizes in per_layer.values()})
            for c in store.classes:
                assert all(sum(per_layer[layer]) == c.bytes_per_expert for layer in c.layers)
                assert all(w.dtype == torch.uint8 and w.shape[0] == c.max_slots
                           for w in store.slot_weights_of(c.layers[0]))
            assert store.bytes_per_expert < float_bytes / 3
            assert store.host.size_bytes == store.num_experts * sum(map(sum, per_layer.values()))
            staging = store.staging.nbytes if store.staging is not None else 0
            assert store.arena.allocated_bytes <= sum(
                c.max_slots * c.bytes_per_expert + 3 * 256 for c in store.classes) + staging + 256
            mode = engine.memory.expert_mode
            assert mode == ("all" if cache == "auto" else "slots")
            assert _greedy(engine) == expected
        finally:
            engine.close()


def test_release_refill_shrink_move_quantized_bytes(tmp_path, monkeypatch) -> None:
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", MIXED, wide=True)
    expected, _ = _reference(path, monkeypatch)
    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    per_layer = _expert_block_bytes(path)
    engine = _engine(path, monkeypatch, quantized=True, expert_cache="24")  # of 32
    try:
        store = engine.memory.experts
        assert [c.max_slots for c in store.classes] == [12, 12]  # 2 layers of 8 experts each
        assert _greedy(engine) == expected
        resident = store.cache.resident()
        released = engine.release_experts()
        assert released["freed_bytes"] >= sum(c.max_slots * c.bytes_per_expert
                                              for c in store.classes)
        refilled = engine.refill_experts()
        assert refilled["differing_slots"] == 0  # slots equal their host copy byte for byte
        assert refilled["copied_bytes"] == sum(sum(per_layer[layer]) for layer, _, _ in resident)
        assert _greedy(engine) == expected
        shrunk = engine.resize_experts(16)
        assert shrunk["num_slots"] == 16
        assert [store.cache.pool_slots(layer) for layer in range(4)] == [8] * 4
        assert _greedy(engine) == expected  # misses read from the host copy's blocks
        engine.resize_experts(24)
        assert _greedy(engine) == expected
        engine.sleep()
        engine.wake()
        assert _greedy(engine) == expected
    finally:
        engine.close()


def test_fast_schedule_on_quantized_experts_matches_the_reference(tmp_path, monkeypatch) -> None:
    """GraphDecoder's decode_step (route, gather-dequantize, grouped kernels) and grouped
    prefill (one projection dequantized at a time) over resident quantized experts. Q8_0:
    the interpreter fails inside its own splat on the mixed K-/I-quant model after the gather
    kernels ran (a TypeError in numpy, not a wrong value); the GPU twin runs that mix."""
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0")
    engine = _engine(path, monkeypatch, quantized=True)
    try:
        expected = _greedy(engine)
        assert isinstance(engine.model.model.layers[0].mlp.experts.gate_proj, QuantizedExperts)
        decoder = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False,
                               min_bucket_tokens=16, prefill_chunk_tokens=20)
        kv = KVCache.for_config(engine.model.config, 64)
        spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
        assert list(decoder.generate(kv, PROMPT, spec, max_new_tokens=NUM_NEW)) == expected
    finally:
        engine.close()


# Q4_K_M-like, every expert type one the fused kernels (expert_gemv.py) read, gate and up
# of different types in layer 1.
PLANES_MIX = alternating_mix(("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q5_K", "Q5_0"))


def count_fused_calls(monkeypatch) -> list[int]:
    """Counts the one-token MoE blocks that took the fused kernels (not dequantize_routed)."""
    from strata.engine.core.quant import expert_gemv

    return count_calls(monkeypatch, expert_gemv, "routed_mlp")


@pytest.mark.parametrize(("overrides", "cache"), [(None, "auto"), (PLANES_MIX, "auto"),
                                                  (PLANES_MIX, "24")],
                         ids=["Q8_0", "Q4_K_M-like", "Q4_K_M-like-partial-cache"])
def test_fused_expert_kernels_decode_like_the_dequantized_path(tmp_path, monkeypatch,
                                                               overrides, cache) -> None:
    """The engine's decode through GraphDecoder (graphs off: the step a CUDA graph captures)
    reads the routed experts' blocks with expert_gemv.py's kernels, resident or through the
    partial cache's slot table (24 slots of 32, 12 in each slot class: some experts read
    from the host copy), and its greedy tokens equal the dequantized model's; the partial
    cache's prefill multiplies the layer's blocks from the staging."""
    from strata.engine.core.memory import expert_staging

    # Only the missing experts come from the host copy: the resident ones are gathered from
    # their slots as blocks (expert_staging.wide_rows), not bridged into the host's runs.
    monkeypatch.setattr(expert_staging, "MAX_GAP_BYTES", 0)
    path = _gguf(tmp_path, "qwen3_moe", "Q8_0", overrides, wide=overrides is not None)
    expected, _ = _reference(path, monkeypatch)
    fused_calls = count_fused_calls(monkeypatch)
    engine = _engine(path, monkeypatch, quantized=True, expert_cache=cache)
    try:
        assert engine.memory.expert_mode == ("all" if cache == "auto" else "slots")
        engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False,
                                   min_bucket_tokens=16, prefill_chunk_tokens=20,
                                   step_hook=engine.memory.promotion)
        assert _greedy(engine) == expected
        num_layers = len(engine.model.model.layers)
        assert fused_calls[0] >= (NUM_NEW - 1) * num_layers
        if cache != "auto":  # the prompt's experts were staged whole (expert_staging.py)
            status = engine.memory.experts.status()
            assert status["staged_bytes"] > 0 and status["gathered_bytes"] > 0
    finally:
        engine.close()


def test_expert_cache_off_keeps_the_blocks_in_the_weights_arena(tmp_path, monkeypatch) -> None:
    path = _gguf(tmp_path, "mixtral", "Q8_0")
    expected, _ = _reference(path, monkeypatch)
    engine = _engine(path, monkeypatch, quantized=True, expert_cache="off")
    try:
        experts = engine.model.model.layers[1].mlp.experts
        assert isinstance(experts.down_proj, QuantizedExperts)
        block_size, block_bytes = GGML_QUANT_SIZES[QT.Q8_0]
        assert experts.down_proj.nbytes == experts.down_proj.numel() // block_size * block_bytes
        assert _greedy(engine) == expected
    finally:
        engine.close()


def test_dp4a_expert_kernels_decode_like_the_planes_kernels(tmp_path, monkeypatch) -> None:
    """bf16 compute (as on a GPU), a Q4_K_M-like MoE: Q4_K gate/up, Q6_K down in layer 0 and
    Q8_0 in layer 1, all by dp4a in expert_gemv.py's kernels (x and the activations in int8);
    the greedy tokens through GraphDecoder equal the planes kernels' (STRATA_DP4A=0).
    Random K-quant blocks of small scales keep the activations moderate."""
    import transformers

    from strata.engine.core import engine as engine_module
    from strata.engine.core.quant import expert_gemv

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = 256
    config.moe_intermediate_size = config.intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mix = {f"blk.{i}.ffn_{p}_exps.weight": "Q4_K" for i in (0, 1) for p in ("gate", "up")}
    mix |= {"blk.0.ffn_down_exps.weight": "Q6_K", "blk.1.ffn_down_exps.weight": "Q8_0"}
    path = write_gguf_from_hf(model, None, tmp_path / "moe.gguf", "Q8_0", random_scale=1e-4,
                              qtype_overrides=mix)
    monkeypatch.setattr(engine_module, "compute_dtype", lambda device, config: torch.bfloat16)
    dp4a_layers = [0]
    fused = expert_gemv.routed_mlp

    def counted(x, gate, up, down, *args, **kwargs):
        dp4a_layers[0] += all(expert_gemv.uses_dp4a(w, x) for w in (gate, up, down))
        return fused(x, gate, up, down, *args, **kwargs)

    monkeypatch.setattr(expert_gemv, "routed_mlp", counted)
    assert_dp4a_matches_planes(monkeypatch, lambda: _engine(path, monkeypatch, quantized=True),
                               PROMPT, 3, graph_decoder=True)  # the prefill's head, two steps
    assert dp4a_layers[0] >= 2 * len(model.model.layers)  # two steps, every layer by dp4a


def test_glm_q4_k_m_fallback_downs_decode_by_dp4a_like_the_planes_kernels(
        tmp_path, monkeypatch) -> None:
    """bf16 compute, a GLM-4.5 in Q4_K_M's mix where the FFN width (288 here, 1408 in
    GLM-4.5-Air) is not whole 256-blocks: llama-quantize writes the downs in Q4_K's
    fallback Q5_0 (layers 0 and 1: the dense MLP, the shared and the routed experts) and
    Q6_K's fallback Q8_0 (layer 2). The Q5_0 products take dp4a, dense (gemv_dp4a) and
    routed (expert_gemv, all three projections), and the greedy tokens and one decode
    step's logits equal the planes kernels' (STRATA_DP4A=0)."""
    import transformers

    from strata.engine.core import engine as engine_module
    from strata.engine.core.quant import expert_gemv, gemv_dp4a

    config = make_tiny_hf_config("glm4_moe")
    config.hidden_size = 256
    config.moe_intermediate_size = config.intermediate_size = 288
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    mix = {"blk.0.ffn_down.weight": "Q5_0"}
    for layer, down in ((1, "Q5_0"), (2, "Q8_0")):
        for part in ("exps", "shexp"):
            mix |= {f"blk.{layer}.ffn_gate_{part}.weight": "Q4_K",
                    f"blk.{layer}.ffn_up_{part}.weight": "Q4_K",
                    f"blk.{layer}.ffn_down_{part}.weight": down}
    path = write_gguf_from_hf(model, None, tmp_path / "glm.gguf", "Q8_0", random_scale=1e-4,
                              qtype_overrides=mix)
    monkeypatch.setattr(engine_module, "compute_dtype", lambda device, config: torch.bfloat16)
    dense_types: list[int] = []
    expert_downs: list[int] = []
    dense_args, fused = gemv_dp4a.kernel_args, expert_gemv.routed_mlp

    def dense_counted(x, raw, qtype, *args, **kwargs):
        dense_types.append(int(qtype))
        return dense_args(x, raw, qtype, *args, **kwargs)

    def experts_counted(x, gate, up, down, *args, **kwargs):
        if all(expert_gemv.uses_dp4a(w, x) for w in (gate, up, down)):
            expert_downs.append(int(down.qtype))
        return fused(x, gate, up, down, *args, **kwargs)

    monkeypatch.setattr(gemv_dp4a, "kernel_args", dense_counted)
    monkeypatch.setattr(expert_gemv, "routed_mlp", experts_counted)

    def check(engine: Engine) -> None:
        assert int(engine.model.model.layers[1].mlp.experts.down_proj.qtype) == int(QT.Q5_0)

    assert_dp4a_matches_planes(monkeypatch, lambda: _engine(path, monkeypatch, quantized=True),
                               PROMPT, 3, graph_decoder=True, check=check)
    assert int(QT.Q5_0) in dense_types  # layer 0's down, the shared expert's
    assert expert_downs.count(int(QT.Q5_0)) >= 2 and int(QT.Q8_0) in expert_downs
