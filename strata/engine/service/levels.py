"""The lifecycle's vocabulary (DESIGN §4), typed: the service's State, each part's Level, the
Actions that move between them, and pure readings of them from the engine's EngineStatus.

Every reader (the lifecycle, /v1/status, /health, /metrics, /v1/models, the rules, the tray's
menu) reads these; nothing re-derives a state from strings. The enums are str-valued, so they
compare with and serialize as the words the API always answered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from strata.engine import protocol as p
from strata.engine.service.status_schema import ArenaBytes


class State(StrEnum):
    """The one word for what the service is doing; the deepest level in effect when idle."""

    LOADED = "loaded"
    BUSY = "busy"
    EXPERTS_RELEASED = "experts_released"
    SESSION_OFFLOADED = "session_offloaded"
    SLEEPING = "sleeping"
    UNLOADED = "unloaded"
    LOADING = "loading"
    WAKING = "waking"
    WAITING_FOR_VRAM = "waiting_for_vram"  # a refused step back up: a state, not a failure
    FAILED = "failed"
    STARTING = "starting"  # the tray's host before the service exists; the service never says it

    @property
    def is_up(self) -> bool:
        """The model is loaded and awake (idle), whatever was released below the weights."""
        return self in (State.LOADED, State.EXPERTS_RELEASED, State.SESSION_OFFLOADED)

    @property
    def is_coming_up(self) -> bool:
        return self in (State.STARTING, State.LOADING, State.WAKING)

    @property
    def health(self) -> tuple[str, int]:
        """/health's (status word, HTTP status): ok while requests can be answered."""
        if self in (State.LOADING, State.STARTING):
            return "loading", 503
        return ("error", 503) if self is State.FAILED else ("ok", 200)

    @property
    def model_status(self) -> str:
        """/v1/models' word: loaded | sleeping | unloaded."""
        if self is State.SLEEPING:
            return "sleeping"
        if self in (State.UNLOADED, State.LOADING, State.FAILED):
            return "unloaded"
        return "loaded"

    @property
    def words(self) -> str:
        """The state in a sentence ("model is ...")."""
        return "error" if self is State.FAILED else self.value.replace("_", " ")


# The states /metrics exports (the service's own; "starting" is the tray host's).
SERVICE_STATES = tuple(s for s in State if s is not State.STARTING)


class Level(StrEnum):
    """Where one part of the model (experts, session, weights) is."""

    RESIDENT = "resident"
    RELEASED = "released"  # experts: the cache's memory given back
    OFFLOADED = "offloaded"  # session: KV in snapshots (RAM, disk)
    SLEEPING = "sleeping"  # weights: host copies kept, memory released
    UNLOADED = "unloaded"  # weights: no engine process holds the model
    NONE = "none"  # no such part: a dense model's experts, an empty session


class Action(StrEnum):
    """A lifecycle verb, as the control API, the tray and the rules name it."""

    LOAD = "load"
    UNLOAD = "unload"
    SLEEP = "sleep"
    WAKE = "wake"
    RELEASE_EXPERTS = "release_experts"
    REFILL_EXPERTS = "refill_experts"
    SHRINK_EXPERTS = "shrink_experts"
    OFFLOAD_SESSION = "offload_session"
    RESTORE_SESSION = "restore_session"

    @classmethod
    def parse(cls, name: str) -> Action | None:
        """The action a name (or its short alias: refill, release, offload) means; None when
        it names none."""
        name = _ALIASES.get(name, name)
        return cls(name) if name in cls._value2member_map_ else None

    @property
    def is_down(self) -> bool:
        """Going down frees memory (refused while a request runs); the others come back."""
        return self in DOWN_ACTIONS

    @property
    def command(self) -> type:
        """The engine command of a level the engine changes itself (not load, unload, shrink)."""
        return _COMMANDS[self]


_ALIASES = {"refill": "refill_experts", "release": "release_experts", "offload": "offload_session"}
DOWN_ACTIONS = (Action.RELEASE_EXPERTS, Action.SHRINK_EXPERTS, Action.OFFLOAD_SESSION,
                Action.SLEEP, Action.UNLOAD)
UP_ACTIONS = (Action.LOAD, Action.WAKE, Action.REFILL_EXPERTS, Action.RESTORE_SESSION)
_COMMANDS = {
    Action.RELEASE_EXPERTS: p.ReleaseExperts, Action.REFILL_EXPERTS: p.RefillExperts,
    Action.OFFLOAD_SESSION: p.OffloadSession, Action.RESTORE_SESSION: p.RestoreSession,
    Action.SLEEP: p.Sleep, Action.WAKE: p.Wake,
}


@dataclass(frozen=True)
class Levels:
    """Each part's level; /v1/status shows it as {experts, session, weights}."""

    experts: Level
    session: Level
    weights: Level

    def as_dict(self) -> dict[str, str]:
        return {"experts": self.experts, "session": self.session, "weights": self.weights}


NOT_LOADED = Levels(Level.NONE, Level.NONE, Level.UNLOADED)
# Slot locations (SlotStatus.location) that hold a session outside VRAM, or nothing at all.
_STORED_LOCATIONS = ("ram", "disk")
_EMPTY_LOCATIONS = ("empty",)


def levels_of(engine: p.EngineStatus) -> Levels:
    """The levels of a loaded engine, read from its own status alone (no host-side flags)."""
    is_sleeping = engine.state is p.EngineState.SLEEPING
    return Levels(_experts_level(engine, is_sleeping), _session_level(engine, is_sleeping),
                  Level.SLEEPING if is_sleeping else Level.RESIDENT)


def _experts_level(engine: p.EngineStatus, is_sleeping: bool) -> Level:
    arena = engine.arenas.get("experts")
    if arena is not None:
        return Level.RELEASED if arena.state == "released" else Level.RESIDENT
    if engine.experts is None:
        return Level.NONE  # a dense model, or the expert cache off
    return Level.RELEASED if is_sleeping else Level.RESIDENT


def _session_level(engine: p.EngineStatus, is_sleeping: bool) -> Level:
    """From the slots' locations. The kv arena's own state cannot tell: its pages follow the
    tokens, so an empty one reads as released without anything having been offloaded."""
    locations = [slot.location for slot in engine.slots]
    if not locations:
        return Level.OFFLOADED if is_sleeping else Level.RESIDENT
    if any(loc not in _STORED_LOCATIONS + _EMPTY_LOCATIONS for loc in locations):
        return Level.RESIDENT
    return Level.OFFLOADED if any(loc in _STORED_LOCATIONS for loc in locations) else Level.NONE


# The level each going-down action reaches, as a test on the levels.
_REACHED = {
    Action.RELEASE_EXPERTS: lambda lv: lv.experts != Level.RESIDENT,
    Action.SHRINK_EXPERTS: lambda lv: lv.experts != Level.RESIDENT,  # partial: resident, serving
    Action.OFFLOAD_SESSION: lambda lv: lv.session != Level.RESIDENT,
    Action.SLEEP: lambda lv: lv.weights != Level.RESIDENT,
    Action.UNLOAD: lambda lv: lv.weights == Level.UNLOADED,
}


def is_level_reached(action: Action, levels: Levels) -> bool:
    """True when the level that `action` goes down to is already reached (or below)."""
    return _REACHED[action](levels)


def idle_state(levels: Levels) -> State:
    """The deepest level in effect, as the state of a loaded engine nothing is running on."""
    if levels.weights == Level.UNLOADED:
        return State.UNLOADED
    if levels.weights == Level.SLEEPING:
        return State.SLEEPING
    if levels.session == Level.OFFLOADED:
        return State.SESSION_OFFLOADED
    if levels.experts == Level.RELEASED:
        return State.EXPERTS_RELEASED
    return State.LOADED


def vram_by_arena(engine: p.EngineStatus | None) -> dict[str, ArenaBytes]:
    """{arena: {resident_bytes, released_bytes}}; {} without a loaded engine."""
    if engine is None:
        return {}
    return {name: {"resident_bytes": arena.resident_bytes,
                   "released_bytes": arena.released_bytes}
            for name, arena in engine.arenas.items()}


def resident_bytes(vram: Mapping[str, ArenaBytes]) -> int:
    """Memory held over all arenas of a status()["vram"]."""
    return sum(int(a.get("resident_bytes") or 0) for a in vram.values())


def freed_bytes(before: p.EngineStatus | None, after: p.EngineStatus | None) -> int:
    """What a level change gave back, from the engine's status before and after it: the one
    place this is computed (the level reply, the rules and the tray read it)."""
    held_before = before.resident_bytes() if before is not None else 0
    held_after = after.resident_bytes() if after is not None else 0
    return max(0, held_before - held_after)


# ---- which actions apply now -----------------------------------------------------------------


@dataclass(frozen=True)
class Allowed:
    """An action, whether it can run now, and why not (may be "" when nothing needs saying)."""

    action: Action
    is_allowed: bool
    reason: str = ""


def allowed_actions(state: State, vram: Mapping[str, Mapping[str, int]]) -> dict[Action, Allowed]:
    """Every level action the state allows, or why not: the one place this is decided (the
    tray's menu and status line read it). `vram` is status()["vram"]."""
    if state is State.BUSY:
        blocked = "a request is running; try again when it is done"
    elif state.is_coming_up:
        blocked = f"the model is {state.words}"
    else:
        blocked = ""
    not_up = f"model is {state.words}"

    def arena(name: str, key: str = "resident_bytes") -> int:
        return int((vram.get(name) or {}).get(key) or 0)

    has_experts = bool(arena("experts") or arena("experts", "released_bytes"))
    checks = {
        Action.REFILL_EXPERTS: (state is State.EXPERTS_RELEASED, "the experts are resident"),
        Action.RELEASE_EXPERTS: (state.is_up and has_experts,
                                 "dense model: no expert cache" if state.is_up else not_up),
        Action.OFFLOAD_SESSION: (state.is_up and state is not State.SESSION_OFFLOADED
                                 and arena("kv") > 0,
                                 "no session in VRAM" if state.is_up else not_up),
        Action.WAKE: (state is State.SLEEPING, "the model is not asleep"),
        Action.SLEEP: (state.is_up, "nothing loaded to put to sleep"),
        Action.LOAD: (state in (State.UNLOADED, State.FAILED), "the model is loaded"),
        Action.UNLOAD: (state.is_up or state is State.SLEEPING, ""),
    }
    return {action: Allowed(action, False, blocked) if blocked
            else Allowed(action, is_ok, "" if is_ok else why)
            for action, (is_ok, why) in checks.items()}
