"""Which cache slot a request without an explicit slot goes to (DESIGN §5).

The idle slot whose cached tokens share the longest prefix with the prompt, if that prefix is
long enough to be worth keeping the conversation together (MIN_PREFIX_TOKENS, and at least
half the prompt: a shared system prompt alone should not pull a new conversation onto another
one's slot); else the least recently used idle slot, an empty one first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIN_PREFIX_TOKENS = 16


@dataclass(frozen=True)
class IdleSlot:
    """A slot no running sequence holds: its cached token ids and when it was last used."""

    slot: int
    tokens: Sequence[int]  # may be () for a snapshot whose ids are unknown (another run's file)
    num_tokens: int  # what the slot holds; 0: empty
    last_used_s: float  # monotonic


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reuse_threshold(num_prompt_tokens: int) -> int:
    """The shortest shared prefix that sends a prompt to a slot for its cache."""
    return max(MIN_PREFIX_TOKENS, num_prompt_tokens // 2)


def choose_slot(prompt: Sequence[int], idle: Sequence[IdleSlot],
                avoid: frozenset[int] = frozenset()) -> int:
    """The slot for `prompt` among `idle` (not empty). Slots in `avoid` (wanted explicitly by
    requests that wait) are taken only when no other slot is idle, and never for a prefix."""
    if not idle:
        raise ValueError("choose_slot needs at least one idle slot")
    best, best_length = None, reuse_threshold(len(prompt)) - 1
    for candidate in idle:
        length = common_prefix_length(candidate.tokens, prompt)
        if length > best_length and candidate.slot not in avoid:
            best, best_length = candidate, length
    if best is not None:
        return best.slot
    free = [c for c in idle if c.slot not in avoid] or list(idle)
    return min(free, key=lambda c: (c.num_tokens > 0, c.last_used_s, c.slot)).slot
