"""Room for one more model of the pool: under --vram-budget (estimated bytes) or in the free
VRAM, the other models go down the levels as model_pool_evict.py plans it.
"""

from __future__ import annotations

import logging
import math

from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, State
from strata.engine.service.model_pool_evict import (
    Candidate,
    budget_need_bytes,
    free_need_bytes,
    plan_eviction,
)
from strata.engine.service.model_pool_member import Pool, PooledModel
from strata.units import MIB

log = logging.getLogger(__name__)
BUDGET_RETRY_AFTER_S = 5.0


async def make_room(pool: Pool, member: PooledModel) -> None:
    """Take other models down the levels, least recently used first, until member fits in
    the budget (else the free VRAM). Raises ServiceError insufficient_vram when a budget
    cannot be met; without one the member's own guard waits for VRAM others may free."""
    target_bytes, held_bytes = member.size.full_bytes, member.held_bytes()
    others = [m for m in pool.members if m is not member]
    budget = pool.budget_bytes
    if budget:
        if target_bytes > budget:
            raise ServiceError("insufficient_vram", f"{member.name} needs "
                               f"{_mib(target_bytes)} MiB, more than the whole VRAM budget "
                               f"of {_mib(budget)} MiB; raise --vram-budget")
        need = budget_need_bytes(budget, target_bytes, held_bytes,
                                 [o.held_bytes() for o in others])
    elif pool.is_gpu:
        free_bytes = await pool.read_free_vram_bytes()
        if free_bytes is None:
            return
        need = free_need_bytes(free_bytes, target_bytes, held_bytes,
                               pool.settings.min_free_vram_mib * MIB)
    else:
        return  # the CPU without a budget: RAM is the OS's to manage
    if need <= 0:
        return
    plan = plan_eviction([_candidate(o, pool.is_gpu) for o in others
                          if o.state() is not None], need)
    if not plan.is_enough:
        if budget:
            raise _no_room(pool, member, plan.shortfall_bytes)
        return  # the guard waits for VRAM that other apps may still free
    for step in plan.steps:
        victim = pool.member(step.name)
        if victim is not None:
            await _take_down(victim, step.action, member.name)
    if budget:
        still = budget_need_bytes(budget, target_bytes, held_bytes,
                                  [o.held_bytes() for o in others])
        if still > 0:
            raise _no_room(pool, member, still)


async def _take_down(victim: PooledModel, action: Action, for_name: str) -> None:
    victim.eviction_cause = f"to make room for {for_name}"
    try:
        result = await victim.service.control(action.value)
        log.info("%s: %s %s, %d MiB freed", victim.eviction_cause, action.replace("_", " "),
                 victim.name, _mib(int(result.get("freed_bytes") or 0)))
    except ServiceError as exc:  # it started serving meanwhile, or the level does not apply
        log.info("could not %s %s to make room for %s: %s", action.replace("_", " "),
                 victim.name, for_name, exc.message)
    finally:
        victim.eviction_cause = None


def _no_room(pool: Pool, member: PooledModel, missing_bytes: int) -> ServiceError:
    busy = [m.name for m in pool.members if m is not member and m.is_busy]
    why = f"; busy: {', '.join(busy)}" if busy else ""
    return ServiceError(
        "insufficient_vram", f"cannot load {member.name} within the VRAM budget of "
        f"{_mib(pool.budget_bytes)} MiB: {_mib(missing_bytes)} MiB missing while the other "
        f"models serve requests{why}; retry later", retry_after_s=BUDGET_RETRY_AFTER_S)


def _mib(num_bytes: int) -> int:
    return math.ceil(num_bytes / MIB)


def _candidate(member: PooledModel, is_gpu: bool) -> Candidate:
    """How the planner sees another model: what each level would leave it holding."""
    state, size = member.state(), member.size
    held = size.held_bytes(state, is_gpu=is_gpu)
    after: dict[Action, int] = {}
    if state in (State.LOADED, State.SESSION_OFFLOADED) and size.expert_bytes:
        after[Action.RELEASE_EXPERTS] = size.held_bytes(State.EXPERTS_RELEASED, is_gpu=is_gpu)
    if state in (State.LOADED, State.SESSION_OFFLOADED, State.EXPERTS_RELEASED):
        after[Action.SLEEP] = size.held_bytes(State.SLEEPING, is_gpu=is_gpu)
    if state not in (None, State.UNLOADED, State.FAILED):
        after[Action.UNLOAD] = 0
    return Candidate(member.name, held, member.last_used_s or 0.0, member.is_busy, after)
