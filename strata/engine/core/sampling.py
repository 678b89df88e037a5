"""Token sampling on the device the logits live on, without a host sync per step.

Greedy is an argmax. Random sampling draws with the exponential-race trick
(argmax(p / Exp(1)) is a draw from p), which needs no cumulative sum and no sync,
the way gpt-fast's `multinomial_sample_one_no_sync` does it.
"""

from __future__ import annotations

import torch

from strata.engine.protocol import SamplingSpec


class Sampler:
    """Samples one token per call from [V] logits according to a SamplingSpec."""

    def __init__(self, spec: SamplingSpec, device: torch.device):
        self.spec = spec
        self.is_greedy = spec.temperature <= 0.0 or spec.top_k == 1
        self._generator: torch.Generator | None = None
        if not self.is_greedy:
            self._generator = torch.Generator(device=device)
            if spec.seed is not None:
                self._generator.manual_seed(spec.seed)
            else:
                self._generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the chosen token id as a 0-dim long tensor on the logits' device."""
        if self.is_greedy:
            return torch.argmax(logits, dim=-1)
        probs = self.probabilities(logits)  # [V]
        noise = torch.empty_like(probs).exponential_(1.0, generator=self._generator)
        return torch.argmax(probs / noise, dim=-1)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Filtered, renormalised probabilities after temperature, top-k, top-p and min-p."""
        spec = self.spec
        logits = logits.float() / spec.temperature
        if 0 < spec.top_k < logits.shape[-1]:
            kth = torch.topk(logits, spec.top_k, dim=-1).values[..., -1:]  # [1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [V]
        if spec.min_p > 0.0:
            floor = probs.max(dim=-1, keepdim=True).values * spec.min_p
            probs = probs.masked_fill(probs < floor, 0.0)
        if spec.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
            sorted_probs = sorted_probs.masked_fill(before >= spec.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return probs / probs.sum(dim=-1, keepdim=True)
