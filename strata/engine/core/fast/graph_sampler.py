"""Token sampling that can live inside a CUDA graph: no host sync, no torch.Generator.

Filtering mirrors Sampler.probabilities (sampling.py); the draw is the same exponential race,
argmax(p / E) with E ~ Exp(1), but the noise comes from a counter-based hash of
(seed, step, token index) computed with integer tensor ops. A graph replays it with a new step
counter each time, and a seeded request gives the same tokens on every run and device.
Logit bias, repetition penalties (a device-side token window, penalties.py) and logprobs are
static buffers too, so requests that use them replay graphs as well; a graph includes each
only when its key asks, so plain requests pay nothing for them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from strata.engine.core.fast import argmax
from strata.engine.core.penalties import (
    TokenWindow,
    dense_bias,
    penalize,
    token_logprob,
    top_logprobs,
)
from strata.engine.protocol import SamplingSpec, TokenLogprob

_MASK_32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**31, so (x < 2**32) * _MIX stays inside int64
_STEP_STRIDE = 0x27D4EB2D
MAX_TOP_LOGPROBS = 20


def sampling_key(spec: SamplingSpec) -> tuple:
    """What a captured graph bakes in; requests with the same key share the graph."""
    is_greedy = spec.temperature <= 0.0 or spec.top_k == 1
    base = ("greedy",) if is_greedy else ("sample", spec.top_k, spec.top_p < 1.0,
                                         spec.min_p > 0.0)
    extras = (("bias", bool(spec.logit_bias)), ("penalties", spec.has_penalties),
              ("logprobs", spec.num_logprobs is not None))
    return base + tuple(name for name, is_on in extras if is_on)


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

    def __init__(self, vocab_size: int, device: torch.device, max_window_tokens: int = 8192):
        """max_window_tokens: the longest penalty window (the model's context length)."""
        self.device = device
        self.vocab_size = vocab_size
        self.token_index = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.seed = torch.zeros(1, dtype=torch.int64, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)
        self.temperature = torch.ones(1, dtype=torch.float32, device=device)
        self.top_p = torch.ones(1, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(1, dtype=torch.float32, device=device)
        self.repeat_penalty = torch.ones(1, dtype=torch.float32, device=device)
        self.presence_penalty = torch.zeros(1, dtype=torch.float32, device=device)
        self.frequency_penalty = torch.zeros(1, dtype=torch.float32, device=device)
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.window = TokenWindow(vocab_size, max_window_tokens, device)
        num_top = min(MAX_TOP_LOGPROBS, vocab_size)
        # One step's logprobs packed as [chosen, top values..., top ids...] (ids as float32:
        # exact below 2**24), so the host copies one row per step.
        self.logprob_row = torch.zeros(1 + 2 * num_top, dtype=torch.float32, device=device)
        self.num_logprobs = 0
        # On CUDA the vocabulary's argmax is argmax.py's one launch, not torch's one-block
        # reduction; the CPU keeps torch's.
        self._argmax_counter = (argmax.new_counter(device)
                                if device.type == "cuda" and argmax.is_usable(device) else None)

    def prepare(self, spec: SamplingSpec, history: Sequence[int] = ()) -> None:
        """Load a request's parameters into the static buffers (before any replay); history:
        the prompt's token ids, which start the penalty window."""
        seed = spec.seed if spec.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.seed.fill_(seed & _MASK_32)
        self.step.zero_()
        self.temperature.fill_(max(spec.temperature, 1e-6))
        self.top_p.fill_(spec.top_p)
        self.min_p.fill_(spec.min_p)
        self.repeat_penalty.fill_(spec.repeat_penalty)
        self.presence_penalty.fill_(spec.presence_penalty)
        self.frequency_penalty.fill_(spec.frequency_penalty)
        self.bias.copy_(dense_bias(spec, self.vocab_size, self.device))
        if spec.has_penalties:
            self.window.reset(history, spec.penalty_last_n)
        self.num_logprobs = spec.num_logprobs or 0

    def probabilities(self, logits: torch.Tensor, key: tuple) -> torch.Tensor:
        """Filtered, renormalised probabilities [V]; the same filters as Sampler.probabilities."""
        _, top_k, has_top_p, has_min_p = key[:4]
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

    def adjust(self, logits: torch.Tensor, key: tuple) -> torch.Tensor:
        """Logits [V] float32 with the bias and penalties the key includes (as Sampler.adjust)."""
        if "bias" not in key and "penalties" not in key:
            return logits  # greedy takes the argmax as is; probabilities() converts
        logits = logits.float()
        if "bias" in key:
            logits = logits + self.bias
        if "penalties" in key:
            logits = penalize(logits, self.window.counts, self.repeat_penalty,
                              self.presence_penalty, self.frequency_penalty)
        return logits

    def _argmax(self, values: torch.Tensor, use_pdl: bool) -> torch.Tensor:
        """torch.argmax(values, dim=-1, keepdim=True) of one row [V]: [1] int64."""
        if self._argmax_counter is None:
            return torch.argmax(values, dim=-1, keepdim=True)
        return argmax.first_max(values, self._argmax_counter, use_pdl)

    def sample(self, logits: torch.Tensor, key: tuple, use_pdl: bool = False) -> torch.Tensor:
        """The next token [1] (int64) from logits [1, V]; advances the step counter on device
        and, as the key asks, the penalty window and the logprob row. use_pdl: the argmax
        launches as a PDL secondary of the kernel that made the logits (pdl.py)."""
        adjusted = self.adjust(logits[0], key)  # [V]
        if key[0] == "greedy":
            token = self._argmax(adjusted, use_pdl)
        elif 0 < key[1] < adjusted.shape[-1]:
            token = self._sample_top_k(adjusted, key)
        else:
            probs = self.probabilities(adjusted, key)  # [V]
            noise = exponential_noise(self.seed, self.step, self.token_index)  # [V]
            self.step.add_(1)
            token = self._argmax(probs / noise, False)
        if "penalties" in key:
            self.window.push(token)
        if "logprobs" in key:
            num_top = (self.logprob_row.shape[0] - 1) // 2
            chosen, values, ids = top_logprobs(logits[0], token, num_top)
            torch.cat([chosen, values, ids.float()], out=self.logprob_row)
        return token

    def _sample_top_k(self, logits: torch.Tensor, key: tuple) -> torch.Tensor:
        """The draw of the full-vocabulary path, over the top-k logits only: tokens outside
        them have probability 0, and the noise is a function of the token id, so the argmax
        is the same, but min-p and top-p sort k values instead of the vocabulary."""
        _, top_k, has_top_p, has_min_p = key[:4]
        values, ids = torch.topk(logits.float() / self.temperature, top_k)  # [k], descending
        probs = torch.softmax(values, dim=-1)
        if has_min_p:
            probs = probs.masked_fill(probs < probs[:1] * self.min_p, 0.0)
        if has_top_p:
            before = torch.cumsum(probs, dim=-1) - probs
            probs = probs.masked_fill(before >= self.top_p, 0.0)
        noise = exponential_noise(self.seed, self.step, ids)  # [k]
        self.step.add_(1)
        return ids.gather(0, torch.argmax(probs / noise, dim=-1, keepdim=True))  # [1]

    def read_logprob(self, token_id: int, row: torch.Tensor | None = None) -> TokenLogprob:
        """The record of a step from its logprob row (default: the live one; syncs)."""
        row = self.logprob_row if row is None else row
        num_top = (row.shape[0] - 1) // 2
        return token_logprob(token_id, row[:1], row[1 : 1 + num_top],
                             row[1 + num_top :].long(), self.num_logprobs)
