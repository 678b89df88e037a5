"""The CUDA-graph sampler with penalties, logit bias, min_p and logprobs: a replayed graph gives
exactly what the same step gives eagerly, and the eager torch Sampler agrees on the logits."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.fast import GraphDecoder
from strata.engine.core.fast.graph_sampler import GraphSampler, sampling_key
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.random_weights import build_random_model
from strata.engine.core.sampling import Sampler
from strata.engine.protocol import SamplingSpec
from tests.helpers.fast_configs import SMALL_CONFIGS

pytestmark = pytest.mark.gpu

PROMPT = [(11 * i + 5) % 512 for i in range(40)]
SPECS = [
    SamplingSpec(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5,
                 frequency_penalty=0.3, penalty_last_n=16),
    SamplingSpec(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=9,
                 repeat_penalty=1.1, penalty_last_n=-1, logit_bias=((5, -100.0), (7, 4.0))),
    SamplingSpec(temperature=0.7, min_p=0.1, seed=3, num_logprobs=5),
    SamplingSpec(temperature=0.0, num_logprobs=0, logit_bias=((11, 1.5),)),
]


def decode(decoder: GraphDecoder, spec: SamplingSpec, num_new: int = 60):
    kv = KVCache.for_config(decoder.model.config, 256, torch.bfloat16, "cuda")
    tokens, records = [], []
    for token in decoder.generate(kv, PROMPT, spec, num_new):
        tokens.append(token)
        records.append(decoder.last_logprob)
    return tokens, records


@pytest.mark.parametrize("spec", SPECS, ids=["penalties", "bias+min_p", "logprobs", "greedy+lp"])
def test_graph_replay_equals_eager_step_with_new_parameters(spec: SamplingSpec) -> None:
    """Positions 40..99 cross buckets 64 -> 128; graphs and the eager step must agree exactly,
    tokens and logprob records alike."""
    model = build_random_model(SMALL_CONFIGS["llama"], "cuda", torch.bfloat16, seed=0, std=0.1)
    graphed = GraphDecoder(model, use_cuda_graphs=True, min_bucket_tokens=64)
    eager = GraphDecoder(model, use_cuda_graphs=False, min_bucket_tokens=64)
    assert graphed.use_cuda_graphs
    got, got_records = decode(graphed, spec)
    want, want_records = decode(eager, spec)
    assert got == want
    assert got_records == want_records
    if spec.num_logprobs is not None:
        assert all(len(r.top) == spec.num_logprobs for r in got_records)
    assert all(key[2] == sampling_key(spec) for key in graphed.runner.graphs)
    # A plain request after it replays graphs without the extras (and is not penalised).
    plain, _ = decode(graphed, SamplingSpec(temperature=0.0))
    assert plain == decode(eager, SamplingSpec(temperature=0.0))[0]


def test_graph_sampler_on_cuda_adjusts_like_the_eager_sampler() -> None:
    spec = SPECS[1]
    vocab = 1000
    history = [1, 7, 7, 8, 2, 5]
    eager = Sampler(spec, torch.device("cuda"), vocab, history)
    graph = GraphSampler(vocab, torch.device("cuda"), max_window_tokens=4096)
    graph.prepare(spec, history)
    key = sampling_key(spec)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(20):
        logits = torch.randn(vocab, device="cuda", generator=generator) * 3
        torch.testing.assert_close(graph.adjust(logits, key), eager.adjust(logits))
        token = eager(logits)
        graph.window.push(token.view(1))
    torch.testing.assert_close(graph.window.counts, eager._window.counts)


def test_engine_on_cuda_sends_logprobs_and_applies_penalties(tmp_path) -> None:
    """Through Engine.generate on the GPU (graphs, prefill, sample_first): one record per
    token, greedy picks the top one, and penalties and logit_bias change the tokens."""
    from strata.engine.core.engine import Engine, EngineConfig
    from tests.helpers.tiny_models import make_tiny_hf_model

    path, _ = make_tiny_hf_model("llama", tmp_path)
    engine = Engine(EngineConfig(model_path=str(path), device="cuda"))
    engine.load()
    assert engine.fast is not None
    prompt = list(range(5, 45))

    def run(**fields) -> tuple[list[int], list]:
        # Each run prefills the whole prompt in a fresh slot: a run that reused the last one's
        # cached prefix would prefill 1 token instead of 40, and bf16 rounding then moved a
        # near-tie of this random model at token 20 (seen on the H200), logprobs or not.
        spec = SamplingSpec(max_tokens=24, temperature=0.0, **fields)
        tokens, records = [], []
        engine.erase_slot(0)
        for ids in engine.generate(prompt, spec, slot=0):
            tokens += ids
            records += engine.take_logprobs()
        return tokens, records

    plain, none = run()
    assert none == []
    tokens, records = run(num_logprobs=3)
    assert tokens == plain and [r.token_id for r in records] == tokens
    # Greedy takes a most likely token: its logprob is the top one's. Compared by value, not
    # id: logits of this random bf16 model tie exactly at times, and argmax takes the lowest
    # id of a tie while CUDA's topk may list another first (seen on the H200).
    assert all(r.logprob == r.top[0][1] and len(r.top) == 3 for r in records), records
    penalised, _ = run(repeat_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    assert penalised != plain
    banned, _ = run(logit_bias=((plain[0], -100.0),))
    assert banned[0] != plain[0]
    engine.close()


@pytest.mark.parametrize("vocab", [128256, 151936, 1000])  # Llama-3's, Qwen3's, one program
def test_cuda_argmax_from_a_replayed_graph_is_torch_argmax(vocab: int) -> None:
    """fast/argmax.py compiled, as the decode graph holds it: launched as a PDL secondary of
    the kernel that writes the logits, replayed with new logits (ties among them), and its
    counter back at 0 after each replay."""
    from strata.engine.core.fast import argmax
    from strata.engine.core.kernels import pdl
    from tests.gpu.gpu_helpers import captured

    source = torch.empty(vocab, device="cuda")
    counter = argmax.new_counter(torch.device("cuda"))
    use_pdl = pdl.is_supported(torch.device("cuda"))

    def step() -> torch.Tensor:
        return argmax.first_max(source * 2.0, counter, use_pdl)

    step()
    graph, token = captured(step)
    for trial in range(6):
        source.copy_(torch.randn(vocab, device="cuda"))
        if trial % 2:  # ties: the lowest index wins, as torch.argmax gives it
            top = source.max()
            source[torch.randint(0, vocab, (5,), device="cuda")] = top
        graph.replay()
        torch.cuda.synchronize()
        assert token.item() == torch.argmax(source * 2.0).item()
        assert counter.item() == 0
    assert argmax.first_max(source.bfloat16(), counter).item() == torch.argmax(
        source.bfloat16()).item()
