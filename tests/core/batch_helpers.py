"""Running requests through the engine's batch API, and checking batched against alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.core.engine import Engine
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec, Usage

# A divergence between batched and alone greedy tokens is accepted only where the two
# candidates' logits differ by less than this: float rounding of a different matmul shape.
NEAR_TIE_LOGIT = 1e-3
# In bf16 on the GPU: the rounding of bf16 activations between layers moves logits further.
BF16_NEAR_TIE = 2e-2
# ... or where an MoE router was this close (k-th minus (k+1)-th expert probability) at a
# position fed while decoding: rounding picked another expert there, which changes that
# token's output by far more than rounding does (measured on the tiny Qwen3-MoE in bf16: a
# margin of 0.0017 gave a logit gap of 3.7 eight tokens later).
NEAR_TIE_ROUTING = 1e-2


class Collected:
    """Every request's tokens, usage and slot, collected from step events."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.usage: dict[str, Usage] = {}
        self.slot: dict[str, int | None] = {}
        self.logprobs: dict[str, list] = {}

    def take(self, events) -> None:
        for event in events:
            if event.error is not None:
                raise event.error
            self.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            self.logprobs.setdefault(event.request_id, []).extend(event.logprobs)
            if event.usage is not None:
                self.usage[event.request_id] = event.usage
                self.slot[event.request_id] = event.slot


def run_batch(engine: Engine, requests: dict[str, tuple[Sequence[int], SamplingSpec, int | None]],
              max_steps: int = 10_000) -> Collected:
    """Add every request, then step until the batch drains."""
    collected = Collected()
    for request_id, (prompt, spec, slot) in requests.items():
        engine.add(request_id, prompt, spec, slot)
    for _ in range(max_steps):
        if not engine.has_work:
            return collected
        collected.take(engine.step())
    raise AssertionError("the batch did not drain")


def alone(engine: Engine, prompt: Sequence[int], spec: SamplingSpec, slot: int) -> list[int]:
    """The request's tokens run on its own, from an empty slot (erased after)."""
    engine.erase_slot(slot)
    tokens = [t for ids in engine.generate(prompt, spec, slot=slot) for t in ids]
    engine.erase_slot(slot)
    return tokens


@torch.inference_mode()
def reference_logits(engine: Engine, ids: Sequence[int]) -> torch.Tensor:
    """Logits [V] after ids, from the model's own forward over a scratch cache."""
    kv = KVCache.for_config(engine.model_config, len(ids), engine.dtype, engine.device)
    return engine.model(torch.tensor(list(ids), device=engine.device), 0, kv,
                        last_only=True)[-1].float().cpu()


@torch.inference_mode()
def routing_margin(engine: Engine, ids: Sequence[int], first: int) -> float | None:
    """The smallest top-k margin of any MoE router (reference forward over ids) at positions
    first.. ; None for a model without experts."""
    from strata.engine.core.models.switch import SparseMoE

    margins: list[float] = []

    def record(module, args, logits, top_k):
        probs = torch.softmax(logits[first:].float(), dim=-1).sort(dim=-1, descending=True)
        margins.append(float((probs.values[:, top_k - 1] - probs.values[:, top_k]).min()))

    handles = [m.router.register_forward_hook(
                   lambda mod, args, out, k=m.top_k: record(mod, args, out, k))
               for m in engine.model.modules() if isinstance(m, SparseMoE)]
    try:
        reference_logits(engine, ids)
    finally:
        for handle in handles:
            handle.remove()
    return min(margins) if margins else None


def assert_same_or_near_tie(engine: Engine, prompt: Sequence[int], expected: list[int],
                            got: list[int], near_tie: float = NEAR_TIE_LOGIT) -> None:
    """Greedy tokens agree, or the first divergence is shown to be a near-tie: the two tokens'
    logits differ by less than near_tie times the largest logit, or (MoE) a router's top-k
    margin was under NEAR_TIE_ROUTING at a position fed since the prompt's last token."""
    if got == expected:
        return
    j = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    assert j is not None, f"lengths differ: {len(expected)} alone, {len(got)} batched"
    ids = [*prompt, *expected[:j]]
    logits = reference_logits(engine, ids)
    gap = abs(float(logits[expected[j]] - logits[got[j]]))
    if gap < near_tie * max(1.0, float(logits.abs().max())):
        return
    margin = routing_margin(engine, ids, len(prompt) - 1)
    assert margin is not None and margin < NEAR_TIE_ROUTING, (
        f"diverged at token {j}: alone {expected[j]}, batched {got[j]}, logit gap {gap:.4g}, "
        f"smallest router margin {margin}")
