"""Which other models go down, and how far, so that one more fits: a pure plan, tested alone.

The shallowest level first across the models, least recently used first within a level: a
released expert cache comes back faster than a sleeping model, a sleeping one faster than an
unloaded one. A model serving a request is never chosen. (Ollama's scheduler evicts whole
models LRU first; the levels let Strata give back less.)
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
    idle = sorted((c for c in candidates if not c.is_busy), key=lambda c: c.last_used_s)
    held = {c.name: c.held_bytes for c in idle}
    steps: list[Step] = []
    missing = need_bytes
    for action in EVICTION_LADDER:
        for candidate in idle:
            after = candidate.after.get(action)
            if after is None or after >= held[candidate.name]:
                continue  # does not apply, or frees nothing more than a step already taken
            freed = held[candidate.name] - after
            steps.append(Step(candidate.name, action, freed))
            held[candidate.name] = after
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
