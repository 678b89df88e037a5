"""What the tray's Models menu and the dashboard's model table show for status()["models"].

Qt-free, beside menu_model.py. The rows are the pool's (POOL_CONTRACT.md, status_schema's
ModelRow): every library model with its state and the VRAM it holds. A status without rows is
the host's own while the server is starting or failed to start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata.app.menu_model import STATE_LABEL, ActionView, gib_text, memory_word
from strata.engine.service.levels import Action, State

# A library model no engine was ever started for: the pool's word beside the service states.
AVAILABLE = "available"
_UP_STATES = {State.LOADED, State.BUSY, State.EXPERTS_RELEASED, State.SESSION_OFFLOADED}
_COMING_UP = {State.LOADING, State.WAKING, State.STARTING}


@dataclass(frozen=True)
class ModelView:
    """One library model as the menu and the table show it."""

    name: str
    state_label: str
    vram_bytes: int
    is_default: bool
    is_downloaded: bool
    up: ActionView  # Load, or Wake for a sleeping model
    down: ActionView  # Unload

    @property
    def label(self) -> str:
        """The menu entry: name, state, and what it holds while it holds anything."""
        held = f" · {gib_text(self.vram_bytes)}" if self.vram_bytes else ""
        fetch = "" if self.is_downloaded else " · downloads on first load"
        return f"{self.name} — {self.state_label}{held}{fetch}"


def model_rows(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The pool's rows; [] while the server is starting or failed (the host's own status)."""
    return list(status.get("models") or [])


def state_label(state: str) -> str:
    return "Available" if state == AVAILABLE else STATE_LABEL[State(state)]


def _actions(state: str, name: str) -> tuple[ActionView, ActionView]:
    """(up, down) for a model in this state: Load/Wake brings it up, Unload takes it down."""
    if state == AVAILABLE:
        return (ActionView(Action.LOAD, "Load", True),
                ActionView(Action.UNLOAD, "Unload", False, f"{name} is not loaded"))
    current = State(state)
    if current in _COMING_UP:
        busy = f"{name} is {STATE_LABEL[current].lower()}"
        return ActionView(Action.LOAD, "Load", False, busy), \
            ActionView(Action.UNLOAD, "Unload", False, busy)
    if current is State.SLEEPING:
        return ActionView(Action.WAKE, "Wake", True), ActionView(Action.UNLOAD, "Unload", True)
    if current in _UP_STATES:
        return (ActionView(Action.LOAD, "Load", False, f"{name} is loaded"),
                ActionView(Action.UNLOAD, "Unload", True))
    # unloaded, failed, waiting for VRAM: a load (again) is what can help
    return (ActionView(Action.LOAD, "Load", True),
            ActionView(Action.UNLOAD, "Unload", False, f"{name} is not loaded"))


def model_views(status: Mapping[str, Any]) -> list[ModelView]:
    """One view per library model, in the pool's order (the default first)."""
    views = []
    for row in model_rows(status):
        name, state = str(row["name"]), str(row["state"])
        up, down = _actions(state, name)
        views.append(ModelView(name=name, state_label=state_label(state),
                               vram_bytes=int(row["vram_bytes"]),
                               is_default=bool(row["is_default"]),
                               is_downloaded=bool(row["is_downloaded"]), up=up, down=down))
    return views


def budget_text(status: Mapping[str, Any]) -> str:
    """The dashboard's line under the table: what the models hold against the budget."""
    held = sum(int(row["vram_bytes"]) for row in model_rows(status))
    budget = int(status.get("vram_budget_bytes") or 0)
    if budget:
        limit = f"budget {gib_text(budget)}"
    else:  # --vram-budget 0: the GPU's free VRAM decides; on the CPU nothing does
        limit = "budget: the free VRAM" if memory_word(status) == "VRAM" else "no budget"
    return f"Models hold {gib_text(held)} · {limit}"


def last_used_text(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
