"""Token sampling that can live inside a CUDA graph: no host sync, no torch.Generator.

Filtering mirrors Sampler.probabilities (sampling.py); the draw is the same exponential race,
argmax(p / E) with E ~ Exp(1), but the noise comes from a counter-based hash of
(seed, step, token index) computed with integer tensor ops. A graph replays it with a new step
counter each time, and a seeded request gives the same tokens on every run and device.
"""

from __future__ import annotations

import os

import torch

from strata.engine.protocol import SamplingSpec

_MASK_32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31, so (x < 2**32) * _MIX stays inside int64
_STEP_STRIDE = 0x27D4EB2D


def sampling_key(spec: SamplingSpec) -> tuple:
    """What a captured graph bakes in; requests with the same key share the graph."""
    is_greedy = spec.temperature <= 0.0 or spec.top_k == 1
    if is_greedy:
        return ("greedy",)
    return ("sample", spec.top_k, spec.top_p < 1.0, spec.min_p > 0.0)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # Thomas Mueller's 32-bit integer mix, with explicit wrap-around in int64.
    x = ((x >> 16) ^ x) * _MIX & _MASK_32
    x = ((x >> 16) ^ x) * _MIX & _MASK_32
    return (x >> 16) ^ x


def exponential_noise(
    seed: torch.Tensor, step: torch.Tensor, token_index: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise [V] (float32) from seed [1], step [1] (int64) and token_index [V] (int64)."""
    x = (token_index + step * _STEP_STRIDE + seed) & _MASK_32
    x = _hash32(_hash32(x) ^ (seed & _MASK_32))
    # 24 high bits -> uniform in (0, 1), never 0 or 1, so -log is finite and positive.
    uniform = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


class GraphSampler:
    """Static device buffers (seed, step, temperature, top_p, min_p) and a capturable sample()."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.device = device
        self.token_index = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(1, dtype=torch.float32, device=device)

    def prepare(self, spec: SamplingSpec) -> None:
        """Load a request's parameters into the static buffers (before any replay)."""
        seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed.fill_(seed & _MASK_32)
        self.step.zero_()
        self.temperature.fill_(max(spec.temperature, 1e-6))
        self.top_p.fill_(spec.top_p)
        self.min_p.fill_(spec.min_p)

    def probabilities(self, logits: torch.Tensor, key: tuple) -> torch.Tensor:
        """Filtered, renormalised probabilities [V]; the same filters as Sampler.probabilities."""
        _, top_k, has_top_p, has_min_p = key
        logits = logits.float() / self.temperature
        if 0 < top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if has_min_p:
            floor = probs.max(dim=-1, keepdim=True).values * self.min_p
            probs = probs.masked_fill(probs < floor, 0.0)
        if has_top_p:
            sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(before >= self.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return probs / probs.sum(dim=-1, keepdim=True)

    def sample(self, logits: torch.Tensor, key: tuple) -> torch.Tensor:
        """The next token [1] (int64) from logits [1, V]; advances the step counter on device."""
        if key[0] == "greedy":
            return torch.argmax(logits, dim=-1)
        probs = self.probabilities(logits[0], key)  # [V]
        noise = exponential_noise(self.seed, self.step, self.token_index)  # [V]
        self.step.add_(1)
        return torch.argmax(probs / noise, dim=-1, keepdim=True)
