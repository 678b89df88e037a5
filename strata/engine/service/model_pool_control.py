"""Level actions that name no model: what the rules and the tray's buttons mean by them.

Going down gives the VRAM back, so it applies to every model that holds some; coming back up
brings back what the last such action took down (the default model when there is none). With
one model this is exactly that model's own action and answer.
"""

from __future__ import annotations

from typing import Any

from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, State
from strata.engine.service.model_pool_member import Pool, PooledModel

_SUMMARY_KEYS = ("action", "changed", "freed_bytes", "reason")


async def control_all(pool: Pool, action: str, **kwargs: Any) -> dict[str, Any]:
    """Run `action` on the models it concerns; the default model's answer (or the first's),
    plus "model" and "results": {name: {action, changed, freed_bytes, reason} or {error}}.
    Raises the first error when the action failed on every model it concerned."""
    level = Action.parse(action)
    if level is None:  # slots and slot actions, or an unknown word: the default model's
        return {**await pool.default.control(action, **kwargs), "model": pool.default.name}
    if level.is_down:
        targets = [m for m in pool.members if _holds_memory(m)] or [pool.default]
    else:
        targets = [m for name in pool.taken_down if (m := pool.member(name)) is not None]
        targets = targets or [pool.default]
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, ServiceError] = {}
    for member in targets:
        try:
            results[member.name] = await member.control(action, **kwargs)
        except ServiceError as exc:
            errors[member.name] = exc
    if not results:
        raise next(iter(errors.values()))
    if level.is_down:
        pool.taken_down = [name for name, r in results.items() if r.get("changed")] or \
            pool.taken_down
    else:
        pool.taken_down = [name for name in pool.taken_down if name in errors]
    name = pool.default.name if pool.default.name in results else next(iter(results))
    summary = {n: {k: r[k] for k in _SUMMARY_KEYS if k in r} for n, r in results.items()}
    summary.update({n: {"error": exc.message, "code": exc.code} for n, exc in errors.items()})
    return {**results[name], "model": name, "results": summary}


def _holds_memory(member: PooledModel) -> bool:
    state = member.state()
    return state is not None and state not in (State.UNLOADED, State.FAILED)
