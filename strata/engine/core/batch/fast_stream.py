"""A sequence decoding alone on the CUDA-graph decoder (fast/decode_graph.py).

While exactly one sequence runs and none waits, the batch has nothing to share, and the
graph decoder's single-sequence steps are the fastest way to decode it. The decoder enqueues
the step that feeds token i before it yields token i, so a token's K/V counts as valid (joins
the cache's tokens) only when the next token comes out; stopping after token i leaves that
step's K/V one position past the valid ones, which the next step (graph or batched) rewrites.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from strata.engine.core.batch.sequence import Sequence
from strata.engine.core.snapshots.kv_state import SlotCache
from strata.engine.protocol import TokenLogprob


class FastStream:
    """Decode steps of one sequence from the graph decoder, one token per `next_token`."""

    def __init__(self, fast, seq: Sequence, grow_kv: Callable[[SlotCache, int], None]):
        """fast: the GraphDecoder. The sequence has a pending token (sampled, not fed) and
        either its own eager sampler, whose place the graph sampler takes here, or none: the
        graph sampler already holds its state (the first token came from sample_first)."""
        self.fast = fast
        self.seq = seq
        if seq.sampler is not None:
            # The penalty window starts from everything seen so far; a seeded draw continues
            # with a counter of its own rather than repeating the first tokens' noise.
            fast.sampler.prepare(seq.sampling, [*seq.prompt, *seq.generated])
            fast.sampler.step.fill_(len(seq.generated))
            seq.sampler = None
        start, num_steps = seq.position, seq.num_remaining
        # Graphs write K/V without asking: map every page this sequence can reach up front.
        grow_kv(seq.cache, start + num_steps + 1)
        if seq.constraint is not None:
            from strata.engine.core.fast.constrained_decode import constrained_decode

            self._steps: Iterator[int] = constrained_decode(
                fast, seq.cache.kv, seq.pending, start, num_steps, seq.sampling, seq.constraint)
        else:
            self._steps = fast.decode(seq.cache.kv, seq.pending, start, num_steps, seq.sampling,
                                      continue_request=True)

    def next_token(self) -> tuple[int, TokenLogprob | None]:
        """The next sampled token and its logprob record (when the request asked)."""
        token = next(self._steps)
        self.seq.cache.tokens.append(self.seq.pending)  # the step that fed it has run
        return token, self.fast.last_logprob

    def close(self) -> None:
        """Stop at a step boundary; the sequence continues elsewhere from its pending token."""
        self._steps.close()
