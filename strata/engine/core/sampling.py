"""Token sampling on the device the logits live on, without a host sync per step.

Greedy is an argmax. Random sampling draws with the exponential-race trick
(argmax(p / Exp(1)) is a draw from p), which needs no cumulative sum and no sync,
the way gpt-fast's `multinomial_sample_one_no_sync` does it. Logit bias and repetition
penalties (penalties.py) adjust the logits first, for greedy and random sampling alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from strata.engine.core.penalties import (
    TokenWindow,
    dense_bias,
    penalize,
    token_logprob,
    top_logprobs,
)
from strata.engine.protocol import SamplingSpec, TokenLogprob


class Sampler:
    """Samples one token per call from [V] logits according to a SamplingSpec."""

    def __init__(self, spec: SamplingSpec, device: torch.device, vocab_size: int | None = None,
                 history: Sequence[int] = (), seed_offset: int = 0):
        """vocab_size and history (the prompt's token ids) are needed for logit_bias and
        penalties: the penalty window starts with the prompt's last tokens. seed_offset: a
        sampler that takes over a running sequence (continuous batching) after that many
        tokens starts a seeded stream of its own, not the first tokens' draws again."""
        self.spec = spec
        self.is_greedy = spec.temperature <= 0.0 or spec.top_k == 1
        self.last_logprob: TokenLogprob | None = None  # of the last token, with num_logprobs
        self._window: TokenWindow | None = None
        self._bias: torch.Tensor | None = None
        if (spec.has_penalties or spec.logit_bias) and vocab_size is None:
            raise ValueError("penalties and logit_bias need the vocabulary size")
        if spec.has_penalties:
            capacity = len(history) + spec.max_tokens if spec.penalty_last_n < 0 \
                else spec.penalty_last_n
            self._window = TokenWindow(vocab_size, capacity, device)
            self._window.reset(history, spec.penalty_last_n)
        if spec.logit_bias:
            self._bias = dense_bias(spec, vocab_size, device)
        self._generator: torch.Generator | None = None
        if not self.is_greedy:
            self._generator = torch.Generator(device=device)
            if spec.seed is not None:
                self._generator.manual_seed((spec.seed + seed_offset) % (1 << 63))
            else:
                self._generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Return the chosen token id as a 0-dim long tensor on the logits' device."""
        adjusted = self.adjust(logits)
        probs = None
        if self.is_greedy:
            token = torch.argmax(adjusted, dim=-1)
        else:
            probs = self.probabilities(adjusted)  # [V]
            noise = torch.empty_like(probs).exponential_(1.0, generator=self._generator)
            token = torch.argmax(probs / noise, dim=-1)
        if self._window is not None:
            self._window.push(token.view(1))
        if self.spec.num_logprobs is not None and self.spec.post_sampling_probs:
            self.last_logprob = post_sampling_record(int(token), probs,
                                                     self.spec.num_logprobs)
        elif self.spec.num_logprobs is not None:
            k = min(max(self.spec.num_logprobs, 1), logits.shape[-1])
            chosen, values, ids = top_logprobs(logits, token, k)
            self.last_logprob = token_logprob(int(token), chosen, values, ids,
                                              self.spec.num_logprobs)
        return token

    def adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [V] float32 with the logit bias added and the repetition penalties applied."""
        spec = self.spec
        logits = logits.float()
        if self._bias is not None:
            logits = logits + self._bias
        if self._window is not None:
            logits = penalize(logits, self._window.counts, spec.repeat_penalty,
                              spec.presence_penalty, spec.frequency_penalty)
        return logits

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


def post_sampling_record(token_id: int, probs: torch.Tensor | None, num_top: int
                         ) -> TokenLogprob:
    """The record of a draw from `probs` [V] (the filtered distribution; None: greedy, all
    the mass on token_id): logs of the probabilities, the top num_top of those above 0."""
    if probs is None:
        return TokenLogprob(token_id, 0.0, ((token_id, 0.0),) if num_top else ())
    k = min(max(num_top, 1), probs.shape[-1])
    values, ids = torch.topk(probs, k, dim=-1)
    chosen = float(probs[token_id])
    top = tuple((int(i), math.log(p)) for i, p in zip(ids.tolist(), values.tolist(), strict=True)
                if p > 0.0)[:num_top]
    return TokenLogprob(token_id, math.log(chosen) if chosen > 0.0 else -math.inf, top)
