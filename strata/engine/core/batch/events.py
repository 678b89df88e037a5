"""What a batch step reports per request: new tokens, and the end of a sequence.

Torch-free, so the engine process and a test engine without torch speak the same events.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.engine.protocol import PromptProgress, TokenLogprob, Usage


@dataclass(frozen=True)
class SequenceEvent:
    """One request's news from a step (or a cancel): tokens, then possibly its end.

    A finished sequence has `usage` (finish_reason stop | length | cancelled); one that failed
    has `error` too (the exception; the request gets an Error, not a Done; its usage says
    "cancelled" and what it had made). `slot` is the cache slot it ran in, None if it never
    got one. `progress`: how far its prompt is, when the request asked (return_progress).
    """

    request_id: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked
    usage: Usage | None = None
    error: Exception | None = None
    slot: int | None = None
    progress: PromptProgress | None = None

    @property
    def is_finished(self) -> bool:
        return self.usage is not None or self.error is not None
