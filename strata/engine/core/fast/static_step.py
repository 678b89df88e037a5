"""One batch-1 decode step over static device buffers: what a decode graph captures.

The step's inputs are fixed device buffers (token id, position, the sampler's state), and the
step writes the sampled token back into the token buffer and advances the position, so step
i+1 can be enqueued before the host has read step i's token. Attention in a step reads a fixed
number of cache slots, so steps are grouped by power-of-two buckets of KV length (slots after
the position masked): a step reads about the used length, not the whole context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Sequence
from typing import Protocol

import torch

from strata.engine.core.fast.forward import HostWork, decode_step_segments
from strata.engine.core.fast.graph_sampler import GraphSampler
from strata.engine.core.fast.pointwise import PointwiseOps
from strata.engine.core.kv_cache import KVCache

DEFAULT_MIN_BUCKET_TOKENS = 256
# The sampling key of a step that stops at the logits (constrained decoding samples outside).
LOGITS_KEY = ("logits",)


class StepHook(Protocol):
    """Work around each decode step, on the host, never inside a graph (an expert cache's
    promotion: memory/expert_promotion.py)."""

    def before_step(self) -> None:
        """Raise to refuse the step (its memory is released); else make ready for it."""

    def after_step(self, num_rows: int = 1) -> None:
        """The step of num_rows rows (a batch step's real rows) is queued (maybe not run):
        note what it will have used."""


def kv_buckets(max_tokens: int, min_bucket_tokens: int = DEFAULT_MIN_BUCKET_TOKENS) -> list[int]:
    """KV-length buckets: powers of two from min_bucket_tokens, the last one max_tokens."""
    if max_tokens <= 0 or min_bucket_tokens <= 0:
        raise ValueError(f"max_tokens and min_bucket_tokens must be positive, not "
                         f"{max_tokens}, {min_bucket_tokens}")
    buckets, size = [], min_bucket_tokens
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return buckets


def bucket_for(position: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `position` (bucket sizes count slots 0..size-1)."""
    for size in buckets:
        if position < size:
            return size
    raise ValueError(f"position {position} is past the KV cache of {buckets[-1]} tokens")


class StaticStep:
    """The buffers a decode step reads and writes, and the step itself (`run`)."""

    def __init__(self, model: torch.nn.Module, ops: PointwiseOps, moe_impl: str,
                 sampler: GraphSampler):
        self.model = model
        self.ops = ops
        self.moe_impl = moe_impl
        self.sampler = sampler
        device = sampler.device
        self.device = device
        self.token_in = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.token_out = torch.zeros(1, dtype=torch.long, device=device)
        self.logits_out = torch.zeros(model.config.vocab_size, dtype=torch.float32,
                                      device=device)  # [V], read by constrained_decode
        self._key_positions: dict[int, torch.Tensor] = {}

    def start(self, first_token: int, start_pos: int) -> None:
        """The next step feeds first_token at start_pos."""
        self.token_in.fill_(first_token)
        self.position.fill_(start_pos)

    def _keys(self, bucket: int) -> torch.Tensor:
        if bucket not in self._key_positions:
            self._key_positions[bucket] = torch.arange(bucket, device=self.device)
        return self._key_positions[bucket]

    def run(self, kv: KVCache, bucket: int, key: tuple) -> None:
        """One step: sample into token_out and token_in (or, for LOGITS_KEY, copy the logits to
        logits_out), then advance the position: `run_segments` with the host's work done
        inline (none unless a layer's misses go to the CPU: then it syncs). Without that, no
        host sync: a graph can hold it."""
        for work in self.run_segments(kv, bucket, key):
            work()

    def run_segments(self, kv: KVCache, bucket: int, key: tuple
                     ) -> Generator[HostWork, None, None]:
        """`run` cut where a partial cache's CPU-computed misses need the host
        (forward.decode_step_segments): yields that work, to be done before resuming."""
        ops = self._ops(kv)
        logits = yield from decode_step_segments(
            self.model, kv, self.token_in, self.position, self._keys(bucket), ops, self.moe_impl,
        )
        self._finish(logits, key, ops)

    def _ops(self, kv: KVCache) -> PointwiseOps:
        ops = self.ops
        if ops.fused_attention and kv.k[0].dtype != self.model.model.embed_tokens.weight.dtype:
            ops = dataclasses.replace(ops, fused_attention=False)  # the kernels need one dtype
        return ops

    def _finish(self, logits: torch.Tensor, key: tuple, ops: PointwiseOps) -> None:
        """Sample (or keep the logits), then advance the position."""
        if key == LOGITS_KEY:  # a constrained request samples after the graph, with its mask
            self.logits_out.copy_(logits[0])
            self.position.add_(1)
            return
        token = self.sampler.sample(logits, key, use_pdl=ops.pdl)  # [1]
        self.token_out.copy_(token)
        self.token_in.copy_(token)
        self.position.add_(1)

    def state(self) -> list[torch.Tensor]:
        """Every buffer a step changes besides K/V: saved and restored around a capture."""
        window = self.sampler.window
        return [self.token_in, self.position, self.token_out, self.sampler.step,
                window.ring, window.counts, window.pos]
