"""What the tray shows for a status(): icon, tooltip, status line, which actions apply. Qt-free.

Keeping this apart from the widgets lets the tray, the dashboard and the tests agree on one
reading of the service's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata.engine.service.expert_shrink import can_shrink
from strata.engine.service.levels import Action, State, allowed_actions
from strata.units import GIB

# service state -> icon name (strata/resources/icons/state-<name>.svg)
ICON_OF_STATE = {
    State.LOADED: "serving",
    State.BUSY: "busy",
    State.EXPERTS_RELEASED: "released",
    State.SESSION_OFFLOADED: "offloaded",
    State.SLEEPING: "sleeping",
    State.UNLOADED: "unloaded",
    State.FAILED: "error",
    State.LOADING: "busy",
    State.WAKING: "busy",
    State.STARTING: "busy",
    State.WAITING_FOR_VRAM: "unloaded",  # a refused load is a state, not an error
}
STATE_LABEL = {
    State.LOADED: "Serving",
    State.BUSY: "Busy",
    State.EXPERTS_RELEASED: "Experts released",
    State.SESSION_OFFLOADED: "Session offloaded",
    State.SLEEPING: "Sleeping",
    State.UNLOADED: "Unloaded",
    State.FAILED: "Error",
    State.LOADING: "Loading",
    State.WAKING: "Waking",
    State.STARTING: "Starting",
    State.WAITING_FOR_VRAM: "Waiting for VRAM",
}
# A level action, done: for the dashboard's log.
DONE_VERB: dict[str, str] = {  # Action is a StrEnum: its plain words look the verbs up too
    Action.RELEASE_EXPERTS: "Released experts",
    Action.REFILL_EXPERTS: "Refilled experts",
    Action.OFFLOAD_SESSION: "Offloaded the session",
    Action.RESTORE_SESSION: "Restored the session",
    Action.SLEEP: "Slept",
    Action.WAKE: "Woke",
    Action.UNLOAD: "Unloaded",
    Action.LOAD: "Loaded",
}
# The four toggles: (shown when the first applies, else the second), with their labels.
_TOGGLES = (
    ((Action.REFILL_EXPERTS, "Refill experts"), (Action.RELEASE_EXPERTS, "Release experts")),
    (None, (Action.OFFLOAD_SESSION, "Offload session")),
    ((Action.WAKE, "Wake"), (Action.SLEEP, "Sleep")),
    ((Action.LOAD, "Load"), (Action.UNLOAD, "Unload")),
)
# The state in which a toggle shows its first action.
_FIRST_WHEN = {Action.REFILL_EXPERTS: (State.EXPERTS_RELEASED,), Action.WAKE: (State.SLEEPING,),
               Action.LOAD: (State.UNLOADED, State.FAILED)}


@dataclass(frozen=True)
class ActionView:
    """One lifecycle menu entry: the control action a click sends and whether it may."""

    action: str
    label: str
    is_enabled: bool
    reason: str = ""  # why it is disabled, for the status line and tooltip


def effective_state(status: Mapping[str, Any]) -> State:
    """The state to show: the service's, with a running request shown as busy."""
    state = State(status["state"])
    return State.BUSY if status.get("is_busy") and state.is_up else state


def queue_length(status: Mapping[str, Any]) -> int:
    return int(status.get("queue_length") or 0)


def arena_bytes(status: Mapping[str, Any], arena: str, key: str = "resident_bytes") -> int:
    return int(((status.get("vram") or {}).get(arena) or {}).get(key) or 0)


def held_bytes(status: Mapping[str, Any]) -> int:
    """VRAM Strata holds now, over all arenas."""
    return sum(arena_bytes(status, a) for a in (status.get("vram") or {}))


def gib_text(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def memory_word(status: Mapping[str, Any]) -> str:
    """What the model's bytes live in: "VRAM" on a GPU, "RAM" where the engine runs on the
    CPU; "memory" before the host has said which."""
    return str(status.get("memory_kind") or "memory")


def lifecycle_actions(status: Mapping[str, Any]) -> list[ActionView]:
    """The four level toggles for this state, each enabled or disabled with a reason, as
    levels.allowed_actions decides."""
    state = effective_state(status)
    allowed = allowed_actions(state, status.get("vram") or {})
    views = []
    for first, second in _TOGGLES:
        action, label = first if first and state in _FIRST_WHEN[first[0]] else second
        decision = allowed[action]
        views.append(ActionView(action, label, decision.is_allowed, decision.reason))
    return views


def shrink_action(status: Mapping[str, Any]) -> tuple[ActionView, int] | None:
    """"Shrink experts": free half of the expert cache while the model keeps answering
    (shrink_experts with keep_free_mib = free VRAM + that half; a cache holding every expert
    switches to a partial one); (view, keep_free_mib), or None when it does not apply (no
    expert cache, model not up, free VRAM unknown)."""
    experts = status.get("experts") or {}
    gpu = status.get("gpu")
    free_bytes = getattr(gpu, "free_bytes", None)
    if (not can_shrink(experts) or free_bytes is None
            or not effective_state(status).is_up):
        return None
    half_bytes = arena_bytes(status, "experts") // 2
    if half_bytes <= 0:
        return None
    keep_free_mib = (free_bytes + half_bytes) >> 20
    label = f"Shrink experts (free {gib_text(half_bytes)}, keep serving)"
    return ActionView("shrink_experts", label, True), keep_free_mib


def status_line(status: Mapping[str, Any]) -> str:
    """One line for the top of the menu: state, VRAM held, and why things are disabled."""
    state = effective_state(status)
    line = f"{STATE_LABEL[state]} · {gib_text(held_bytes(status))} {memory_word(status)}"
    if state == "failed" and status.get("last_error"):
        return f"{line} · {status['last_error']}"
    reasons = []
    for view in lifecycle_actions(status):
        if not view.is_enabled and view.reason and view.reason not in reasons:
            reasons.append(view.reason)
    return f"{line} · {'; '.join(reasons)}" if reasons else line


def tooltip(status: Mapping[str, Any]) -> str:
    """Tray tooltip: model, state, VRAM held, endpoint, and the kernel notice (no Triton)."""
    state = effective_state(status)
    lines = [
        f"Strata — {status.get('model') or 'no model'}",
        f"{STATE_LABEL[state]}, {gib_text(held_bytes(status))} held in " + memory_word(status),
        str(status.get("endpoint") or "endpoint not up yet"),
    ]
    if status.get("kernel_notice"):
        lines.append(str(status["kernel_notice"]))
    return "\n".join(lines)
