"""One request inside the batch: its prompt, slot, sampling state and progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.engine.protocol import PromptProgress, SamplingSpec, Usage

if TYPE_CHECKING:
    from strata.engine.core.constraint import TokenConstraint
    from strata.engine.core.sampling import Sampler
    from strata.engine.core.snapshots.kv_state import SlotCache


class Phase(enum.Enum):
    WAITING = "waiting"  # in the FIFO: no slot yet
    PREFILL = "prefill"  # holds its slot; prompt tokens still to run, a chunk per step
    DECODE = "decode"  # one token per step in the batched forward (or the graph decoder)
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request from add() to its end. The cache's `tokens` are the ids whose K/V are valid;
    `pending` is the last sampled token, which the next decode step feeds."""

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    requested_slot: int | None  # None: the scheduler chooses (batch/slot_choice.py)
    stop_ids: frozenset[int]
    max_new: int  # max_tokens, capped by the room left in the context
    constraint: TokenConstraint | None = None
    phase: Phase = Phase.WAITING
    slot: int | None = None
    cache: SlotCache | None = None
    # The eager sampler; None while the graph decoder's sampler holds this sequence's state.
    sampler: Sampler | None = None
    num_cached: int = 0  # prompt tokens reused from the slot
    generated: list[int] = field(default_factory=list)
    pending: int | None = None
    finish_reason: str = "cancelled"
    # time.monotonic() when it was added, got its slot, made its first and its last token.
    added_s: float = field(default_factory=time.monotonic)
    started_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None

    @property
    def num_prefilled(self) -> int:
        """Prompt tokens whose K/V are in the cache (the reused prefix included)."""
        return min(len(self.cache.tokens), len(self.prompt)) if self.cache is not None else 0

    @property
    def position(self) -> int:
        """Where the next token fed goes: the number of valid cached tokens."""
        return len(self.cache.tokens)

    @property
    def num_remaining(self) -> int:
        """Tokens this sequence may still sample."""
        return self.max_new - len(self.generated)

    def take_token(self, token: int) -> bool:
        """Record a sampled token; True when it ends the sequence (stop id, grammar, length)."""
        self.generated.append(token)
        self.pending = token
        self.last_token_s = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = self.last_token_s
        if token in self.stop_ids or (self.constraint is not None and self.constraint.is_stopped):
            self.finish_reason = "stop"  # a complete grammar that allows no end token stops too
            return True
        if self.num_remaining <= 0:
            self.finish_reason = "length"  # max_tokens, or the end of the context
            return True
        return False

    def progress(self, *, is_start: bool = False) -> PromptProgress:
        """How far the prompt's evaluation is now (SamplingSpec.return_progress); is_start:
        the report before its first chunk, whose evaluation time is 0 by definition."""
        started_s = self.started_s if self.started_s is not None else time.monotonic()
        prefill_s = 0.0 if is_start else time.monotonic() - started_s
        return PromptProgress(self.request_id, total=len(self.prompt), cached=self.num_cached,
                              processed=self.num_prefilled, prefill_s=prefill_s)

    def usage(self) -> Usage:
        """Token counts and the engine's timings so far."""
        now_s = time.monotonic()
        started_s = self.started_s if self.started_s is not None else now_s
        first_s = self.first_token_s if self.first_token_s is not None else now_s
        last_s = self.last_token_s if self.last_token_s is not None else first_s
        return Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.generated),
                     cached_tokens=self.num_cached, finish_reason=self.finish_reason,
                     queued_s=started_s - self.added_s, prefill_s=first_s - started_s,
                     decode_s=last_s - first_s)

