"""Which other models go down, and how far, so that one more fits: a pure plan, tested alone.

Least recently used first, as Ollama's scheduler evicts; each model goes only as far down as
frees what is still missing (a released expert cache comes back faster than a sleeping model,
a sleeping one faster than an unloaded one), else as far as frees the most, and the next one
follows. A model serving a request is never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from strata.engine.service.levels import Action

# The levels that free a model's memory, shallowest first. An offload frees KV only, which no
# estimate counts; sleep frees it along with the weights.
EVICTION_LADDER = (Action.RELEASE_EXPERTS, Action.SLEEP, Action.UNLOAD)


@dataclass(frozen=True)
class Candidate:
    """Another model as the planner sees it.

    held_bytes: what it holds now; after: what it would hold after each action that applies
    (an action missing here does not apply: a dense model has no expert cache to release);
    last_used_s: a monotonic time, smaller is older; is_busy: serving or about to serve."""

    name: str
    held_bytes: int
    last_used_s: float
    is_busy: bool = False
    after: dict[Action, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    name: str
    action: Action
    freed_bytes: int


@dataclass(frozen=True)
class Plan:
    """The steps in order, and whether they make the room (False: do them anyway, then 503)."""

    steps: tuple[Step, ...]
    is_enough: bool
    shortfall_bytes: int  # what is still missing after every step (0 when enough)


def plan_eviction(candidates: Iterable[Candidate], need_bytes: int) -> Plan:
    """The steps that free at least need_bytes from the candidates (need <= 0: none)."""
    if need_bytes <= 0:
        return Plan((), True, 0)
    steps: list[Step] = []
    missing = need_bytes
    for candidate in sorted((c for c in candidates if not c.is_busy),
                            key=lambda c: c.last_used_s):
        levels = [(action, candidate.held_bytes - after) for action in EVICTION_LADDER
                  if (after := candidate.after.get(action)) is not None
                  and after < candidate.held_bytes]
        if not levels:
            continue
        # The shallowest level that frees what is missing, else the one that frees the most.
        action, freed = next(((a, f) for a, f in levels if f >= missing),
                             max(levels, key=lambda level: level[1]))
        steps.append(Step(candidate.name, action, freed))
        missing -= freed
        if missing <= 0:
            return Plan(tuple(steps), True, 0)
    return Plan(tuple(steps), False, missing)


def budget_need_bytes(budget_bytes: int, target_bytes: int, target_held_bytes: int,
                      others_held: Sequence[int]) -> int:
    """Bytes the others must free so that the target, grown to target_bytes, fits in the budget
    with what they hold (<= 0: it fits now)."""
    return sum(others_held) + max(target_bytes, target_held_bytes) - budget_bytes


def free_need_bytes(free_bytes: int, target_bytes: int, target_held_bytes: int,
                    reserve_bytes: int) -> int:
    """Bytes to free so that the target's growth plus the reserve fits in free VRAM."""
    return max(0, target_bytes - target_held_bytes) + reserve_bytes - free_bytes
