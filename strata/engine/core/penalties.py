"""Repetition penalties, logit bias and logprobs as device tensor ops, capturable in a graph.

TokenWindow keeps per-token counts of the last N tokens (prompt and output) on the device and
updates them with index ops, so a CUDA graph can push each sampled token without a host sync.
Both samplers (sampling.py eager, fast/graph_sampler.py in graphs) call the same functions, so
the two paths apply exactly the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.engine.protocol import SamplingSpec, TokenLogprob


class TokenWindow:
    """Counts [V] of the tokens in a sliding window of the last `length` tokens.

    The ring holds the window's token ids (-1: empty); `pos` is where the next one goes.
    """

    def __init__(self, vocab_size: int, capacity: int, device: torch.device):
        self.capacity = max(1, capacity)
        self.ring = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=device)
        self.length = torch.full((1,), self.capacity, dtype=torch.int64, device=device)
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    def reset(self, history: Sequence[int], last_n: int) -> None:
        """Start from the last `last_n` tokens of history (-1: all, up to the capacity)."""
        length = self.capacity if last_n < 0 else max(1, min(last_n, self.capacity))
        recent = list(history)[-length:] if last_n != 0 else []
        self.length.fill_(length)
        self.ring.fill_(-1)
        self.counts.zero_()
        if recent:
            ids = torch.tensor(recent, dtype=torch.int64, device=self.ring.device)
            self.ring[: len(recent)] = ids
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        self.pos.fill_(len(recent) % length)

    def push(self, token: torch.Tensor) -> None:
        """Add token [1] (int64), dropping the one that leaves the window; no host sync."""
        index = self.pos  # [1], always < length
        old = self.ring.index_select(0, index)  # [1]
        self.counts.index_add_(0, old.clamp(min=0), -(old >= 0).float())
        self.ring.index_copy_(0, index, token.view(1))
        self.counts.index_add_(0, token.view(1), self._one)
        self.pos.copy_((index + 1) % self.length)


def penalize(logits: torch.Tensor, counts: torch.Tensor, repeat, presence, frequency
             ) -> torch.Tensor:
    """llama.cpp's penalties on logits [V] float32 (repeat/presence/frequency: floats or [1]).

    A seen token's logit is divided by `repeat` when positive, multiplied when not, then
    `frequency` per occurrence and `presence` once are subtracted."""
    seen = counts > 0  # [V]
    repeated = torch.where(logits > 0, logits / repeat, logits * repeat)
    logits = torch.where(seen, repeated, logits)
    return logits - counts * frequency - seen.float() * presence


def dense_bias(spec: SamplingSpec, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The request's logit_bias as a vector [V] (float32) added to the logits."""
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if spec.logit_bias:
        ids = torch.tensor([i for i, _ in spec.logit_bias], dtype=torch.int64, device=device)
        values = torch.tensor([b for _, b in spec.logit_bias], dtype=torch.float32, device=device)
        bias.index_put_((ids,), values, accumulate=True)
    return bias


def top_logprobs(logits: torch.Tensor, token: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the chosen token's logprob [1], top-k logprobs [k], their ids [k]) from raw logits [V]:
    log-softmax before any penalty, bias or temperature, as OpenAI reports them."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    values, ids = torch.topk(logprobs, k, dim=-1)
    return logprobs.gather(0, token.view(1)), values, ids


def token_logprob(token_id: int, chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor,
                  num_top: int) -> TokenLogprob:
    """The host-side record of one step (syncs: call it where the host reads the token)."""
    top_values = values[:num_top].tolist()
    top_ids = ids[:num_top].tolist()
    return TokenLogprob(token_id, float(chosen.reshape(-1)[0]),
                        tuple(zip((int(i) for i in top_ids), top_values)))
