"""The dp4a A/B of the CPU quant tests: one engine's greedy tokens and one decode step's
logits with STRATA_DP4A=0 (the planes kernels) and =1 (dp4a), which must agree."""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata.engine.core.engine import Engine
from strata.engine.core.fast import GraphDecoder
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec

# One step's logits within what rounding x to int8 costs, relative to the largest logit.
MAX_LOGIT_ERROR = 3e-2


@torch.inference_mode()
def decode_logits(engine: Engine, prompt: list[int], token: int) -> torch.Tensor:
    """Logits [V] of one decode step (token after prompt) through the model's forward."""
    kv = KVCache.for_config(engine.model_config, 64, engine.dtype, engine.device)
    engine.model(torch.tensor(prompt), 0, kv, last_only=True)  # prefill: dequantized
    return engine.model(torch.tensor([token]), len(prompt), kv, last_only=True)[-1].float()


def assert_dp4a_matches_planes(monkeypatch, make_engine: Callable[[], Engine],
                               prompt: list[int], max_tokens: int, graph_decoder: bool = False,
                               check: Callable[[Engine], None] | None = None) -> None:
    """Greedy tokens (through a GraphDecoder without graphs when graph_decoder) and the first
    decode step's logits of make_engine()'s engine, with dp4a off then on: tokens equal,
    logits within MAX_LOGIT_ERROR. `check` runs on each engine once loaded."""
    tokens, logits = {}, {}
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0)
    for switch in ("0", "1"):
        monkeypatch.setenv("STRATA_DP4A", switch)
        engine = make_engine()
        try:
            assert engine.dtype == torch.bfloat16
            if check is not None:
                check(engine)
            if graph_decoder:
                engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False,
                                           compile_pointwise=False, min_bucket_tokens=16,
                                           prefill_chunk_tokens=20,
                                           step_hook=engine.memory.promotion)
            tokens[switch] = [t for step in engine.generate(prompt, spec) for t in step]
            logits[switch] = decode_logits(engine, prompt, tokens[switch][0])
        finally:
            engine.close()
    assert tokens["1"] == tokens["0"]
    error = (logits["1"] - logits["0"]).abs().max() / logits["0"].abs().max()
    assert error <= MAX_LOGIT_ERROR, error
