"""A partial expert cache's one-token misses computed on the CPU (fast/moe_cpu_misses.py), on
a tiny Qwen3-MoE GGUF whose experts are Q4_K (exact in the CPU's int4 form): greedy decode
gives the all-resident model's tokens and logits, the misses are computed on the CPU (none
read from the host copy in place), promoted between steps as before, and bad settings are
refused in one line."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the first Triton import (see test_fast_paths.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.forward import decode_step
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.loader import load_model_config
from strata.engine.core.memory.backend import backend_for
from strata.engine.core.residency import ModelMemory
from strata.engine.core.weight_source import FileWeights
from strata.engine.protocol import SamplingSpec
from tests.helpers.gguf_writer import write_gguf_from_hf
from tests.helpers.tiny_models import make_tiny_hf_config

PROMPT = [(7 * i + 3) % 300 for i in range(19)]  # > 16 tokens: the staged grouped prefill
NUM_NEW = 6  # each interpreted decode step costs CI seconds
GREEDY = SamplingSpec(max_tokens=64, temperature=0.0)
LOGITS_TOLERANCE = 1e-4  # float32 both ways; only the sums' order differs


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers of 8 experts, rows of 256: whole Q4_K blocks) in Q4_K."""
    import transformers

    config = make_tiny_hf_config("qwen3_moe")
    config.hidden_size = 256
    config.moe_intermediate_size = config.intermediate_size = 256
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("cpu_misses") / "qwen3_moe-q4_k.gguf"
    return write_gguf_from_hf(model, None, path, "Q4_K")


def _decode(path, expert_cache: str, mode: str, monkeypatch, **split):
    """(greedy tokens, logits of the step after them, ModelMemory, decoder); close after.
    split: CpuMisses.max_per_layer and share."""
    monkeypatch.setenv("STRATA_QUANTIZED", "1")  # experts stay in their Q4_K blocks
    config = load_model_config(str(path))
    memory = ModelMemory(backend_for("cpu"), torch.float32, mode)
    model = memory.build(config, FileWeights.open(str(path), config), expert_cache)
    if memory.cpu_misses is not None:
        memory.cpu_misses.wait_converted()  # "on" converts every expert as it starts
        for name, value in split.items():
            setattr(memory.cpu_misses, name, value)
    if memory.experts is not None:  # promote within these few tokens (no admission margin)
        memory.experts.cache.admit_margin_uses = 0.0
    decoder = GraphDecoder(model, moe_impl="triton", min_bucket_tokens=16,
                           step_hook=memory.promotion)
    kv = KVCache.for_config(config, 64)
    tokens = list(decoder.generate(kv, PROMPT, GREEDY, NUM_NEW))
    position = len(PROMPT) + NUM_NEW - 1
    with torch.inference_mode():
        logits = decode_step(model, kv, torch.tensor([tokens[-1]]), torch.tensor([position]),
                             torch.arange(64), moe_impl="triton")
    return tokens, logits, memory, decoder


def test_cpu_misses_decode_like_all_resident_and_still_promote(q4k_gguf, monkeypatch) -> None:
    tokens, logits, memory, _ = _decode(q4k_gguf, "all", "on", monkeypatch)
    try:
        assert memory.expert_mode == "all" and memory.cpu_misses is None  # nothing to miss
    finally:
        memory.close()
    # 12 slots of 16 experts: layer 0's 8 and 4 of layer 1's, whose steps mix hits and misses.
    got, got_logits, memory, decoder = _decode(q4k_gguf, "12", "on", monkeypatch)
    try:
        store, cpu = memory.experts, memory.cpu_misses
        assert memory.expert_mode == "slots" and store.is_quantized and cpu is not None
        assert decoder.moe_impl == "triton"
        assert got == tokens
        assert float((got_logits - logits).abs().max()) < LOGITS_TOLERANCE * float(
            logits.abs().max())
        status = store.status()
        # Every miss was computed on the CPU: none read in place; every expert was converted
        # once, as "on" started, none on the decode path.
        assert status["num_cpu_experts"] > 0 and status["host_read_bytes"] == 0
        assert status["num_cpu_conversions"] == 16 == status["cpu_cached_experts"]
        assert status["cpu_expert_misses"] == "on" and status["cpu_cache_bytes"] > 0
        assert status["num_cpu_overlapped_layers"] > 0  # hits on the GPU, misses on the CPU
        assert sum(row["num_cpu_experts"] for row in status["layers"]) == (
            status["num_cpu_experts"])
        # Promotion still counts those misses and moves experts into slots.
        assert status["num_misses"] > 0 and status["num_evictions"] > 0
    finally:
        memory.close()


def test_a_layer_with_hits_and_misses_equals_its_resident_self(q4k_gguf, monkeypatch) -> None:
    """Layer 1 with 4 of its 8 experts in slots: one token's top-2 are all hits, all misses
    or both; each way its output equals the all-resident layer's (the GPU's hits at their
    weights, the CPU's misses at theirs, none counted twice)."""
    from strata.engine.core.fast.moe_grouped import moe_forward

    _, _, resident, resident_decoder = _decode(q4k_gguf, "all", "off", monkeypatch)
    _, _, partial, partial_decoder = _decode(q4k_gguf, "12", "on", monkeypatch)
    try:
        want_layer = _moe_layers(resident_decoder.model)[1]
        got_layer = _moe_layers(partial_decoder.model)[1]
        cpu = partial.cpu_misses
        g = torch.Generator().manual_seed(0)
        kinds = set()
        for _ in range(64):  # until each kind has come (seeded: about 30)
            x = torch.randn(1, 256, generator=g)
            before = (cpu.num_layer_calls, cpu.num_overlapped_calls, sum(
                partial.experts.traffic.num_cpu_experts))
            with torch.inference_mode():
                want = moe_forward(want_layer, x, "triton")
                got = moe_forward(got_layer, x, "triton")
                split = _split_phases(got_layer, x)  # what the split step's segments run
            for out in (got, split):
                assert float((out - want).abs().max()) <= LOGITS_TOLERANCE * float(
                    want.abs().max())
            num_cpu = sum(partial.experts.traffic.num_cpu_experts) - before[2]
            kinds.add("mixed" if cpu.num_overlapped_calls > before[1] else
                      "all missed" if num_cpu else "all hit")
            assert cpu.num_layer_calls == before[0] + 2
            if len(kinds) == 3:
                break
        assert kinds == {"mixed", "all missed", "all hit"}
    finally:
        partial.close()
        resident.close()


def _split_phases(moe, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer's output by LayerCpuMisses' split phases, the host's work inline."""
    from strata.engine.core.fast.moe_grouped import gpu_experts, route_token, slot_layout

    layout = slot_layout(moe)
    misses = layout.cpu_misses
    weights, ids = route_token(moe, x, layout)
    misses.stage(x, ids, weights)
    misses.split(moe)
    out = misses.hits(gpu_experts(moe, x, layout))
    misses.join()
    return misses.combine(out, x.dtype)


def _moe_layers(model) -> list:
    from strata.engine.core.models.switch import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_the_split_step_answers_like_the_one_call_path(q4k_gguf, monkeypatch) -> None:
    """The called step with CPU misses is cut where the host works
    (forward.decode_step_segments, what split graphs replay: fast/split_runner.py) and run
    with that work inline: the all-resident tokens; each MoE layer yields the host two
    pieces of work (split, then join)."""
    from strata.engine.core.fast.split_runner import SplitEagerRunner

    tokens, _, memory, _ = _decode(q4k_gguf, "all", "off", monkeypatch)
    memory.close()
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    config = load_model_config(str(q4k_gguf))
    memory = ModelMemory(backend_for("cpu"), torch.float32, "on")
    try:
        model = memory.build(config, FileWeights.open(str(q4k_gguf), config), "12")
        decoder = GraphDecoder(model, moe_impl="triton", min_bucket_tokens=16,
                               step_hook=memory.promotion)
        assert isinstance(decoder.runner, SplitEagerRunner)  # the called step is cut too
        works: list[str] = []
        original = decoder.step.run_segments

        def counted(kv, bucket, key):
            for work in original(kv, bucket, key):
                works.append(getattr(work, "func", work).__name__)
                yield work

        decoder.step.run_segments = counted
        got = list(decoder.generate(KVCache.for_config(config, 64), PROMPT, GREEDY, NUM_NEW))
        assert got == tokens
        num_steps = NUM_NEW - 1  # the first token comes from the prefill
        assert works == ["split", "join"] * 2 * num_steps  # 2 MoE layers a step
        status = memory.experts.status()
        assert status["num_cpu_experts"] > 0 and status["host_read_bytes"] == 0
        # and one more: the prefill's last chunk runs the last layer's MLP for its last
        # token only, by the one-call path
        assert status["num_cpu_split_layers"] == 2 * num_steps + 1
        # The split step's host time, by where it went (the CPU device waits for no GPU).
        from strata.engine.core.fast.moe_cpu_misses import HOST_TIMES

        assert all(status[key] >= 0.0 for key in HOST_TIMES)
        assert status["cpu_split_host_s"] > 0.0 and status["cpu_join_wait_s"] > 0.0
    finally:
        memory.close()


def test_preconvert_makes_the_missing_experts_forms_within_the_bound(q4k_gguf,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    config = load_model_config(str(q4k_gguf))
    memory = ModelMemory(backend_for("cpu"), torch.float32, "auto")
    try:
        memory.build(config, FileWeights.open(str(q4k_gguf), config), "12")
        store, cpu = memory.experts, memory.cpu_misses
        missing = int((store.table_mirror[store.layer_ids] < 0).sum())
        assert missing == 4  # 16 experts, 12 slots
        assert cpu.preconvert() == missing and len(cpu.cache) == missing
        assert cpu.preconvert() == 0 and cpu.cache.num_conversions == missing  # kept
        one = cpu.cache.nbytes // missing
        cpu.cache.clear()
        cpu.cache.limit_bytes = 2 * one  # room for two: stops before evicting
        assert cpu.preconvert() == 2 and cpu.cache.num_evictions == 0
    finally:
        memory.close()


@pytest.mark.parametrize("split", [{"max_per_layer": 1}, {"share": 0.5}, {"balance": True}],
                         ids=["max_per_layer", "share", "balance"])
def test_misses_past_the_cap_are_read_in_place_and_the_answer_is_the_same(
        q4k_gguf, monkeypatch, split) -> None:
    """max_per_layer 1, or share 0.5 of top-2, or each layer's balanced share from a half: a
    step whose two experts both miss computes one on the CPU and reads the other over the
    host copy, at once; the tokens are the all-resident model's. On the CPU the "GPU" has
    always finished when the CPU's sum lands, so the balanced shares only fall."""
    tokens, _, memory, _ = _decode(q4k_gguf, "all", "off", monkeypatch)
    memory.close()
    got, _, memory, _ = _decode(q4k_gguf, "8", "on", monkeypatch, **split)
    try:
        cpu, status = memory.cpu_misses, memory.experts.status()
        assert got == tokens
        assert 0 < status["num_cpu_experts"] <= cpu.num_layer_calls  # one a layer call at most
        assert status["host_read_bytes"] > 0  # the second miss of a layer, read in place
        if split.get("balance"):
            shares = {layer: b.share for layer, b in cpu.balances.items()}
            assert shares and all(b.num_observed > 0 for b in cpu.balances.values())
            assert all(share < 0.5 for share in shares.values()), shares
            assert status["cpu_share_mean"] == pytest.approx(sum(shares.values()) / len(shares))
    finally:
        memory.close()


def test_misses_read_in_place_when_off(q4k_gguf, monkeypatch) -> None:
    """The same partial cache with the mode off reads its misses over the host copy: what
    the CPU path saves, and the counters that tell the two apart."""
    _, _, memory, _ = _decode(q4k_gguf, "8", "off", monkeypatch)
    try:
        status = memory.experts.status()
        assert memory.cpu_misses is None and status["num_cpu_experts"] == 0
        assert status["host_read_bytes"] > 0 and "num_cpu_conversions" not in status
    finally:
        memory.close()


def test_auto_converts_in_the_background_then_computes_on_the_cpu(q4k_gguf,
                                                                  monkeypatch) -> None:
    """auto: a miss whose CPU form is not made yet is read in place and converted on the
    side; a miss whose form is kept is computed on the CPU. Tokens stay the resident ones."""
    other = [(5 * i + 1) % 300 for i in range(17)]
    tokens, _, memory, decoder = _decode(q4k_gguf, "all", "off", monkeypatch)
    try:
        other_tokens = list(decoder.generate(KVCache.for_config(decoder.model.config, 64),
                                             other, GREEDY, NUM_NEW))
    finally:
        memory.close()
    got, _, memory, decoder = _decode(q4k_gguf, "8", "auto", monkeypatch)
    try:
        store, cpu = memory.experts, memory.cpu_misses
        assert got == tokens
        cpu.wait_converted()
        memory.promotion.before_step()  # count the last step's misses (read in place) now
        first = store.status()
        assert first["host_read_bytes"] > 0 and first["num_cpu_conversions"] > 0
        for layer in store.layer_ids:  # every form made: no miss is read in place now
            for expert in range(store.num_experts):
                cpu.cache.expert(layer, expert)
        kv = KVCache.for_config(decoder.model.config, 64)
        assert list(decoder.generate(kv, other, GREEDY, NUM_NEW)) == other_tokens
        memory.promotion.before_step()
        second = store.status()
        assert second["num_cpu_experts"] > first["num_cpu_experts"]
        assert second["host_read_bytes"] == first["host_read_bytes"]
    finally:
        memory.close()


def test_an_engine_with_cpu_misses_answers_like_all_resident(q4k_gguf, monkeypatch) -> None:
    """The engine wires EngineConfig.cpu_expert_misses through: its partial cache (the fast
    path on the CPU, the Triton interpreter) computes misses on the CPU, and its greedy
    answer is the all-resident engine's; status shows the CPU forms."""
    from strata.engine.core.engine import Engine

    monkeypatch.setenv("STRATA_QUANTIZED", "1")
    spec = SamplingSpec(max_tokens=NUM_NEW, temperature=0.0)
    answers, statuses = [], []
    for expert_cache, mode in (("all", "off"), ("12", "on")):
        engine = Engine(EngineConfig(
            model_path=str(q4k_gguf), device="cpu", context_tokens=64,
            expert_cache=expert_cache, cpu_expert_misses=mode,
            fast_compile_pointwise=True if expert_cache != "all" else None,
            snapshot_ram_budget_bytes=1 << 20))
        engine.load()
        try:
            answers.append([t for step in engine.generate(PROMPT, spec) for t in step])
            statuses.append(engine.status()["experts"])
            if mode == "on":
                assert engine.fast is not None and not engine.fast.use_cuda_graphs
        finally:
            engine.close()
    assert answers[1] == answers[0]
    assert statuses[1]["mode"] == "slots" and statuses[1]["cpu_expert_misses"] == "on"
    assert statuses[1]["num_cpu_experts"] > 0 and statuses[1]["num_cpu_conversions"] > 0


def test_a_live_shrink_switches_to_cpu_misses(tmp_path, monkeypatch) -> None:
    """An all-resident float MoE loaded with cpu_expert_misses on shrinks while a stream
    decodes (test_live_shrink.py's case): from the switch on, the called step is cut and the
    misses are computed on the CPU (float experts: views of the host copy, nothing kept);
    the tokens stay the unshrunk ones."""
    from strata.engine.core import residency
    from strata.engine.core.engine import Engine
    from strata.engine.core.fast.split_runner import SplitEagerRunner
    from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
    from tests.helpers.tiny_models import make_tiny_hf_model

    page_bytes = 16 * 1024  # small arena chunks, so the shrink frees some
    monkeypatch.setattr(residency, "EXPERTS_CHUNK_BYTES", page_bytes)
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path / "moe",
                                 overrides={"num_hidden_layers": 2})
    prompt = [(7 * i + 3) % 96 for i in range(8)]
    spec = SamplingSpec(max_tokens=6, temperature=0.0)
    engine = Engine(EngineConfig(model_path=str(path), device="cpu", context_tokens=128,
                                 expert_cache="all", cpu_expert_misses="on",
                                 snapshot_ram_budget_bytes=1 << 20),
                    backend=CpuMmapBackend(granularity_bytes=page_bytes))
    engine.load()
    try:
        engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False)
        reference = [t for step in engine.generate(prompt, spec, slot=0) for t in step]
        assert engine.memory.cpu_misses is None  # all resident: nothing to miss
        tokens: list[int] = []
        for step in engine.generate(prompt, spec, slot=1):
            tokens.extend(step)
            if len(tokens) == 3:
                engine.resize_experts(engine.memory.experts.num_experts)  # one layer's worth
        assert tokens == reference
        assert isinstance(engine.fast.runner, SplitEagerRunner)
        status = engine.status()["experts"]
        assert status["mode"] == "slots" and status["cpu_expert_misses"] == "on"
        assert status["num_cpu_experts"] > 0 and status["cpu_cache_bytes"] == 0
    finally:
        engine.close()


def test_bad_settings_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="cpu_expert_misses must be one of off, on, auto, "
                                         "not 'sometimes'"):
        EngineConfig(model_path="x", cpu_expert_misses="sometimes")
    with pytest.raises(ValueError, match="cpu_expert_cache_bytes must be >= 0"):
        EngineConfig(model_path="x", cpu_expert_cache_bytes=-1)
    with pytest.raises(ValueError, match="cpu_expert_misses must be one of"):
        ModelMemory(backend_for("cpu"), torch.float32, "yes")
