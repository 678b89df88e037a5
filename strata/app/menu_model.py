"""What the tray shows for a status(): icon, tooltip, status line, which actions apply. Qt-free.

Keeping this apart from the widgets lets the tray, the dashboard and the tests agree on one
reading of the service's state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata.units import GIB

# service state (levels.STATES, plus the host's "starting") -> icon name
# (strata/resources/icons/state-<name>.svg)
ICON_OF_STATE = {
    "loaded": "serving",
    "busy": "busy",
    "experts_released": "released",
    "session_offloaded": "offloaded",
    "sleeping": "sleeping",
    "unloaded": "unloaded",
    "failed": "error",
    "loading": "busy",
    "waking": "busy",
    "starting": "busy",
    "waiting_for_vram": "unloaded",  # a refused load is a state, not an error
}
STATE_LABEL = {
    "loaded": "Serving",
    "busy": "Busy",
    "experts_released": "Experts released",
    "session_offloaded": "Session offloaded",
    "sleeping": "Sleeping",
    "unloaded": "Unloaded",
    "failed": "Error",
    "loading": "Loading",
    "waking": "Waking",
    "starting": "Starting",
    "waiting_for_vram": "Waiting for VRAM",
}
_UP_STATES = {"loaded", "experts_released", "session_offloaded"}
# A level action, done: for the dashboard's log.
DONE_VERB = {
    "release_experts": "Released experts",
    "refill_experts": "Refilled experts",
    "offload_session": "Offloaded the session",
    "restore_session": "Restored the session",
    "sleep": "Slept",
    "wake": "Woke",
    "unload": "Unloaded",
    "load": "Loaded",
}


@dataclass(frozen=True)
class ActionView:
    """One lifecycle menu entry: the control action a click sends and whether it may."""

    action: str
    label: str
    is_enabled: bool
    reason: str = ""  # why it is disabled, for the status line and tooltip


def effective_state(status: Mapping[str, Any]) -> str:
    """The state to show: the service's, with a running request shown as busy."""
    state = str(status.get("state", "starting"))
    return "busy" if status.get("is_busy") and state in _UP_STATES else state


def queue_length(status: Mapping[str, Any]) -> int:
    return int(status.get("queue_length") or 0)


def arena_bytes(status: Mapping[str, Any], arena: str, key: str = "resident_bytes") -> int:
    return int(((status.get("vram") or {}).get(arena) or {}).get(key) or 0)


def held_bytes(status: Mapping[str, Any]) -> int:
    """VRAM Strata holds now, over all arenas."""
    return sum(arena_bytes(status, a) for a in (status.get("vram") or {}))


def has_experts(status: Mapping[str, Any]) -> bool:
    """True when the model has an expert cache (resident or released)."""
    return bool(arena_bytes(status, "experts") or arena_bytes(status, "experts", "released_bytes"))


def gib_text(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def memory_word(status: Mapping[str, Any]) -> str:
    """What the model's bytes live in: "VRAM" on a GPU, "RAM" where the engine runs on the
    CPU; "memory" before the host has said which."""
    return str(status.get("memory_kind") or "memory")


def lifecycle_actions(status: Mapping[str, Any]) -> list[ActionView]:
    """The four level toggles for this state, each enabled or disabled with a reason."""
    state = effective_state(status)
    if state == "busy":
        blocked = "a request is running; try again when it is done"
    elif state in ("starting", "loading", "waking"):
        blocked = f"the model is {state}"
    else:
        blocked = ""

    def view(action: str, label: str, ok: bool, why: str) -> ActionView:
        if blocked:
            return ActionView(action, label, False, blocked)
        return ActionView(action, label, ok, "" if ok else why)

    is_up = state in _UP_STATES
    if state == "experts_released":
        experts = view("refill_experts", "Refill experts", True, "")
    else:
        no_experts = (
            "dense model: no expert cache"
            if "vram" in status
            else "the service reports no expert cache"
        )
        experts = view(
            "release_experts",
            "Release experts",
            is_up and has_experts(status),
            no_experts if is_up else f"model is {STATE_LABEL.get(state, state).lower()}",
        )
    offload = view(
        "offload_session",
        "Offload session",
        is_up and state != "session_offloaded" and arena_bytes(status, "kv") > 0,
        "no session in VRAM" if is_up else f"model is {STATE_LABEL.get(state, state).lower()}",
    )
    if state == "sleeping":
        sleep = view("wake", "Wake", True, "")
    else:
        sleep = view("sleep", "Sleep", is_up, "nothing loaded to put to sleep")
    if state in ("unloaded", "failed"):
        load = view("load", "Load", True, "")
    else:
        load = view("unload", "Unload", is_up or state == "sleeping", "")
    return [experts, offload, sleep, load]


def shrink_action(status: Mapping[str, Any]) -> tuple[ActionView, int] | None:
    """"Shrink experts": free half of a partial expert cache while the model keeps answering
    (shrink_experts with keep_free_mib = free VRAM + that half); (view, keep_free_mib), or
    None when it does not apply (no partial cache, model not up, free VRAM unknown)."""
    experts = status.get("experts") or {}
    gpu = status.get("gpu")
    free_bytes = getattr(gpu, "free_bytes", None)
    if (experts.get("mode") != "slots" or free_bytes is None
            or effective_state(status) not in _UP_STATES):
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
    line = f"{STATE_LABEL.get(state, state)} · {gib_text(held_bytes(status))} {memory_word(status)}"
    if state == "failed" and status.get("last_error"):
        return f"{line} · {status['last_error']}"
    reasons = []
    for view in lifecycle_actions(status):
        if not view.is_enabled and view.reason and view.reason not in reasons:
            reasons.append(view.reason)
    return f"{line} · {'; '.join(reasons)}" if reasons else line


def tooltip(status: Mapping[str, Any]) -> str:
    """Tray tooltip: model, state, VRAM held, endpoint."""
    state = effective_state(status)
    return "\n".join(
        [
            f"Strata — {status.get('model') or 'no model'}",
            f"{STATE_LABEL.get(state, state)}, {gib_text(held_bytes(status))} held in "
            + memory_word(status),
            str(status.get("endpoint") or "endpoint not up yet"),
        ]
    )
