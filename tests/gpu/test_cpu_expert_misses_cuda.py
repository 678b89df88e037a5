"""A partial expert cache on CUDA with cpu_expert_misses on (fast/moe_cpu_misses.py): decode
steps cut at each MoE layer, called or replayed as split graphs (fast/split_runner.py),
compute each layer's misses on the CPU while the GPU computes its hits, and the answer is
the all-resident model's; a Q4_K layer with hits and misses equals its resident self within
the bf16 CPU form's error. Run by the next device session:
    python -m pytest -q -s tests/gpu/test_cpu_expert_misses_cuda.py"""

from __future__ import annotations

import time

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from tests.helpers.moe_cache_cuda import CONFIG, GREEDY, PROMPT, settle

pytestmark = pytest.mark.gpu

NUM_DECODE = 8
BF16_TOLERANCE = 3e-2  # relative to max |out|: bf16 activations and int4 scales on the CPU


def _build(expert_cache: str, mode: str):
    from strata.engine.core.memory.backend import backend_for
    from strata.engine.core.residency import ModelMemory
    from strata.engine.core.weight_source import RandomWeights

    backend = backend_for("cuda")
    memory = ModelMemory(backend, torch.bfloat16, mode)
    model = memory.build(CONFIG, RandomWeights(backend.device, std=0.1), expert_cache)
    if memory.cpu_misses is not None:
        memory.cpu_misses.wait_converted()  # "on" converts every expert as it starts
    if memory.experts is not None:  # promote within these few tokens (no admission margin)
        memory.experts.cache.admit_margin_uses = 0.0
    return memory, model


@pytest.fixture(scope="module")
def expected() -> list[int]:
    """The all-resident model's greedy tokens, which every partial cache's decode equals."""
    memory, model = _build("all", "off")
    try:
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        return list(GraphDecoder(model, min_bucket_tokens=64).generate(
            kv, PROMPT, GREEDY, NUM_DECODE))
    finally:
        memory.close()


def test_decode_with_cpu_misses_equals_all_resident(expected) -> None:
    memory, model = _build("16", "on")  # 16 slots of 48 experts
    try:
        store, cpu = memory.experts, memory.cpu_misses
        assert memory.expert_mode == "slots" and cpu is not None
        decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=memory.promotion)
        assert decoder.moe_impl == "triton" and not decoder.use_cuda_graphs, decoder.note
        assert "CPU-computed expert misses" in decoder.note
        from strata.engine.core.fast.split_runner import SplitEagerRunner

        assert isinstance(decoder.runner, SplitEagerRunner)
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        started_s = time.perf_counter()
        tokens = list(decoder.generate(kv, PROMPT, GREEDY, NUM_DECODE))
        seconds = time.perf_counter() - started_s
        settle(memory.promotion)
        assert tokens == expected
        status = store.status()
        print(f"cpu misses: {seconds / NUM_DECODE * 1e3:.1f} ms a token (forms made before; "
              f"eager split) {status['num_cpu_experts']} experts on the CPU, "
              f"{status['num_cpu_overlapped_layers']} layers overlapped, "
              f"{status['num_cpu_conversions']} conversions in {status['cpu_convert_s']:.3f} s")
        assert status["num_cpu_experts"] > 0 and status["host_read_bytes"] == 0
        assert status["num_cpu_overlapped_layers"] > 0
        assert store.verify_slots() == 0  # promotion still moved experts in, intact
        assert status["num_evictions"] > 0
    finally:
        memory.close()


def test_split_graphs_with_cpu_misses_equal_all_resident(expected, monkeypatch) -> None:
    """STRATA_CPU_MISS_GRAPHS=1: the step cut at each MoE layer (fast/split_runner.py) is
    captured as 1 + 2 x 3 graphs and replayed with the host's work between them; the
    tokens are the all-resident model's, misses computed on the CPU."""
    from strata.engine.core.fast.split_runner import SplitGraphRunner

    monkeypatch.setenv("STRATA_CPU_MISS_GRAPHS", "1")
    memory, model = _build("16", "on")
    try:
        decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=memory.promotion)
        assert decoder.use_cuda_graphs and isinstance(decoder.runner, SplitGraphRunner)
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        tokens = list(decoder.generate(kv, PROMPT, GREEDY, NUM_DECODE))
        settle(memory.promotion)
        assert tokens == expected
        (graphs, works), = decoder.runner.segments.values()
        assert len(graphs) == 1 + 2 * CONFIG.num_hidden_layers and len(works) == len(graphs) - 1
        status = memory.experts.status()
        assert status["num_cpu_experts"] > 0 and status["host_read_bytes"] == 0
        # The same steps again, timed against the called ones of the first test's print.
        started_s = time.perf_counter()
        list(decoder.decode(kv, expected[0], len(PROMPT), NUM_DECODE - 1, GREEDY,
                            continue_request=True))
        print(f"split graphs: {(time.perf_counter() - started_s) / (NUM_DECODE - 1) * 1e3:.1f}"
              " ms a token")
    finally:
        memory.close()


def _decode_settled(memory, model) -> list[int]:
    """The greedy tokens of a fresh decoder over the memory's cache, its promotion settled."""
    decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=memory.promotion)
    kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
    tokens = list(decoder.generate(kv, PROMPT, GREEDY, NUM_DECODE))
    settle(memory.promotion)
    return tokens


def status_mean(memory) -> float:
    return memory.experts.status()["cpu_share_mean"]


def test_balanced_shares_equal_all_resident_and_move(expected, monkeypatch) -> None:
    """CpuMisses.balance over the split graphs: each layer's CPU share moves a step a token
    by whether the GPU still ran the layer's hits when the CPU's sum landed (an event
    queried, fast/cpu_share.py); the tokens stay the all-resident model's."""
    monkeypatch.setenv("STRATA_CPU_MISS_GRAPHS", "1")
    memory, model = _build("16", "on")
    try:
        cpu = memory.cpu_misses
        cpu.balance = True
        assert _decode_settled(memory, model) == expected
        balances = cpu.balances.values()
        assert balances and all(b.num_observed > 0 for b in balances)
        assert status_mean(memory) == pytest.approx(
            sum(b.share for b in balances) / len(balances))
        print("balanced shares:", {layer: round(b.share, 2) for layer, b in cpu.balances.items()})
    finally:
        memory.close()


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_prefetch_equals_all_resident_and_its_guesses_land(expected, monkeypatch,
                                                           graphs) -> None:
    """CpuMisses.start_prefetch (fast/moe_prefetch.py), called and over split graphs: at
    each MoE layer's split the next layer's router guesses its experts from this layer's x
    and the missing ones are copied in on the side stream behind the work queued before
    the hits; the next split publishes those that landed. The tokens stay the all-resident
    model's; every copied guess is scored at its layer's split (a hit, late, or unused);
    the slots hold their experts intact."""
    monkeypatch.setenv("STRATA_CPU_MISS_GRAPHS", graphs)
    memory, model = _build("16", "on")
    try:
        prefetch = memory.cpu_misses.start_prefetch(2)
        assert _decode_settled(memory, model) == expected
        status = memory.experts.status()
        print(f"prefetch (graphs {graphs}):", {k: status[k] for k in (
            "num_prefetched", "prefetch_recall", "num_prefetch_hits", "num_prefetch_late",
            "num_prefetch_unused", "num_cpu_experts")})
        assert status["num_prefetched"] > 0 and status["prefetch_recall"] is not None
        scored = prefetch.num_hits + prefetch.num_late + prefetch.num_unused
        pending = sum(len(v) for v in prefetch._copied.values())  # the last split's guess
        assert scored + pending == status["num_prefetched"]
        assert memory.experts.verify_slots() == 0
    finally:
        memory.close()


def test_a_right_guess_lands_before_the_next_layer_splits(monkeypatch) -> None:
    """Forced routes guessed from their trace at recall 1.0 over the split graphs: the
    copies start behind the work queued before a layer's hits and most land before the
    next layer splits (hits; the rest late); the tokens equal the same forced decode
    without a prefetch."""
    from strata.engine.core.models.forced_routing import ForcedRouting, TraceGuess
    from tests.helpers.moe_cache_cuda import NUM_LAYERS, TOP_K, E
    from tests.helpers.routing_trace import random_trace

    monkeypatch.setenv("STRATA_CPU_MISS_GRAPHS", "1")
    trace = random_trace(NUM_DECODE + 1, NUM_LAYERS, E, TOP_K, 5)

    def forced_decode(recall):
        memory, model = _build("16", "on")
        decoder = GraphDecoder(model, min_bucket_tokens=64, step_hook=memory.promotion)
        forced = ForcedRouting(trace, E, torch.device("cuda"))
        forced.attach(model, decoder)
        if recall is not None:
            memory.cpu_misses.start_prefetch(TOP_K, TraceGuess(forced, recall))
        kv = KVCache.for_config(CONFIG, 256, torch.bfloat16, "cuda")
        tokens = list(decoder.generate(kv, PROMPT, GREEDY, NUM_DECODE))
        settle(memory.promotion)
        forced.detach()
        return tokens, memory

    want, memory = forced_decode(None)
    memory.close()
    got, memory = forced_decode(1.0)
    try:
        assert got == want
        status = memory.experts.status()
        print("right guesses:", {k: status[k] for k in (
            "num_prefetched", "num_prefetch_hits", "num_prefetch_late", "num_prefetch_unused")})
        assert status["prefetch_recall"] == 1.0 and status["num_prefetch_unused"] == 0
        assert status["num_prefetch_hits"] > 0
        assert memory.experts.verify_slots() == 0
    finally:
        memory.close()


def test_q4k_layer_with_hits_and_misses_equals_its_resident_self(tmp_path, monkeypatch) -> None:
    """A Q4_K GGUF on CUDA: one MoE layer with some experts in slots, for tokens whose top-k
    are all hits, all misses or both, equals the all-resident layer (the GPU's dp4a or
    dequantizing kernels for hits, torch's int4 CPU kernel for misses)."""
    import transformers

    from strata.engine.core.fast.moe_grouped import moe_forward
    from strata.engine.core.loader import load_model_config
    from strata.engine.core.memory.backend import backend_for
    from strata.engine.core.models.switch import SparseMoE
    from strata.engine.core.residency import ModelMemory
    from strata.engine.core.weight_source import FileWeights
    from tests.helpers.gguf_writer import write_gguf_from_hf
    from tests.helpers.tiny_models import make_tiny_hf_config

    hf_config = make_tiny_hf_config("qwen3_moe")  # 2 layers of 8 experts
    hf_config.hidden_size = 256
    hf_config.moe_intermediate_size = hf_config.intermediate_size = 256
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    path = write_gguf_from_hf(hf_model.eval(), None, tmp_path / "q4_k.gguf", "Q4_K")
    config = load_model_config(str(path))

    def layer(expert_cache: str, mode: str):
        memory = ModelMemory(backend_for("cuda"), torch.bfloat16, mode)
        model = memory.build(config, FileWeights.open(str(path), config), expert_cache)
        return memory, [m for m in model.modules() if isinstance(m, SparseMoE)][1]

    resident, want_layer = layer("all", "off")
    partial, got_layer = layer("12", "on")  # layer 0's 8 experts and 4 of layer 1's
    try:
        assert partial.experts.is_quantized and partial.cpu_misses is not None
        cpu, kinds = partial.cpu_misses, set()
        g = torch.Generator().manual_seed(0)
        for _ in range(64):
            x = torch.randn(1, 256, generator=g).to("cuda", torch.bfloat16)
            before = (cpu.num_overlapped_calls, sum(partial.experts.traffic.num_cpu_experts))
            with torch.inference_mode():
                want = moe_forward(want_layer, x, "triton").float()
                got = moe_forward(got_layer, x, "triton").float()
            assert float((got - want).abs().max()) <= BF16_TOLERANCE * float(want.abs().max())
            num_cpu = sum(partial.experts.traffic.num_cpu_experts) - before[1]
            kinds.add("mixed" if cpu.num_overlapped_calls > before[0] else
                      "all missed" if num_cpu else "all hit")
            if len(kinds) == 3:
                break
        assert kinds == {"mixed", "all missed", "all hit"}
    finally:
        partial.close()
        resident.close()
