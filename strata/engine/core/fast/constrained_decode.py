"""Decode steps under a grammar: the graph runs the forward, the mask joins before sampling.

A constrained step cannot live wholly in a CUDA graph, since its mask depends on the token the
step before it chose. So the graph stops at the logits (LOGITS_KEY), and while the GPU runs it
the host computes the grammar's bitmask for that step (llguidance); the mask is copied over,
applied, and the request's own sampler draws. The GPU waits for the host only for the mask
copy and the token read-back; the forward itself overlaps the mask computation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from strata.engine.core.constraint import TokenConstraint
from strata.engine.core.fast.decode_graph import GraphDecoder
from strata.engine.core.fast.graph_sampler import sampling_key
from strata.engine.core.fast.static_step import LOGITS_KEY, bucket_for, kv_buckets
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec


@torch.inference_mode()
def constrained_decode(decoder: GraphDecoder, kv: KVCache, first_token: int, start_pos: int,
                       max_new_tokens: int, spec: SamplingSpec,
                       constraint: TokenConstraint) -> Iterator[int]:
    """Feed first_token at start_pos, then yield up to max_new_tokens tokens the grammar allows.

    The sampler state is the one `decoder.sample_first` loaded for this request (penalty
    window included); with spec.num_logprobs, `decoder.last_logprob` holds the yielded
    token's record, as after `decoder.decode`."""
    if start_pos < 0 or start_pos + max_new_tokens > kv.max_tokens:
        raise ValueError(f"decoding {max_new_tokens} tokens from position {start_pos} does not "
                         f"fit the KV cache of {kv.max_tokens} tokens: ask for fewer tokens")
    key = sampling_key(spec)
    step, runner = decoder.step, decoder.runner
    step.start(first_token, start_pos)
    buckets = kv_buckets(kv.max_tokens, decoder.min_bucket_tokens)
    for i in range(max_new_tokens):
        # The runner calls the step hook around the step, as decoding does.
        runner.run_step(kv, bucket_for(start_pos + i, buckets), LOGITS_KEY)
        constraint.fill_bitmask()  # host work, while the GPU runs the step just queued
        logits = step.logits_out.masked_fill(~constraint.allowed(), float("-inf"))  # [V]
        token = step.sampler.sample(logits[None], key)  # [1]
        step.token_in.copy_(token)
        token_id = int(token.item())
        constraint.consume(token_id)
        if spec.num_logprobs is not None:
            decoder.last_logprob = step.sampler.read_logprob(token_id)
        yield token_id
