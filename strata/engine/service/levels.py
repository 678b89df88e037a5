"""Pure readings of the lifecycle levels (DESIGN §4) from the engine's last status.

Kept apart from lifecycle.py so the words the API, the tray and the rules see — level names,
the state word, VRAM per arena — are derived in one place, without any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata.engine.service.error_codes import RETRY_AFTER_S as CODE_RETRY_AFTER_S
from strata.engine.service.error_codes import STORAGE_ADVICE, http_status
from strata.engine.service.facade import ServiceError
from strata.engine.service.supervisor import EngineCommandError
from strata.engine.service.vram_guard import RETRY_AFTER_S

STATES = ("loaded", "busy", "experts_released", "session_offloaded", "sleeping", "unloaded",
          "loading", "waking", "failed")
NOT_LOADED = {"experts": "none", "session": "none", "weights": "unloaded"}
# Slot locations (engine slots_status) that hold a session outside VRAM, or nothing at all.
_STORED_LOCATIONS = ("ram", "disk")
_EMPTY_LOCATIONS = ("empty",)
# The level each going-down action reaches, as a test on the levels dict.
_REACHED = {
    "release_experts": lambda lv: lv["experts"] != "resident",
    "offload_session": lambda lv: lv["session"] != "resident",
    "sleep": lambda lv: lv["weights"] != "resident",
    "unload": lambda lv: lv["weights"] == "unloaded",
}


def experts_level(info: Mapping[str, Any], *, is_sleeping: bool, is_released: bool) -> str:
    """resident | released | none (no expert cache), preferring the engine's own arena state."""
    arena = (info.get("arenas") or {}).get("experts")
    if isinstance(arena, Mapping):
        return "released" if arena.get("state") == "released" else "resident"
    if info.get("experts") is None and not is_released:
        return "none"  # a dense model, or an engine that reports no expert cache
    return "released" if is_sleeping or is_released else "resident"


def session_level(info: Mapping[str, Any], *, is_sleeping: bool, is_offloaded: bool) -> str:
    """resident | offloaded | none, from the slots' locations when the engine reports them.

    The kv arena's own state cannot tell: its pages follow the tokens, so an empty one reads
    as released without anything having been offloaded.
    """
    slots = info.get("slots")
    locations = [s.get("location") for s in slots if isinstance(s, Mapping)] if isinstance(
        slots, list) else []
    if any(loc is not None for loc in locations):
        if any(loc not in _STORED_LOCATIONS + _EMPTY_LOCATIONS for loc in locations):
            return "resident"
        return "offloaded" if any(loc in _STORED_LOCATIONS for loc in locations) else "none"
    return "offloaded" if is_sleeping or is_offloaded else "resident"


def is_level_reached(action: str, levels: Mapping[str, str]) -> bool:
    """True when the level that `action` goes down to is already reached (or below)."""
    return _REACHED[action](levels)


def state_word(levels: Mapping[str, str]) -> str:
    """The deepest level in effect, as the state word of a loaded engine."""
    if levels["weights"] == "unloaded":
        return "unloaded"
    if levels["weights"] == "sleeping":
        return "sleeping"
    if levels["session"] == "offloaded":
        return "session_offloaded"
    if levels["experts"] == "released":
        return "experts_released"
    return "loaded"


def vram_by_arena(info: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """{arena: {resident_bytes, released_bytes}} from an engine status; {} when it has none."""
    arenas = info.get("arenas") or {}
    return {
        str(name): {
            "resident_bytes": int(arena.get("resident_bytes") or 0),
            "released_bytes": int(arena.get("released_bytes") or 0),
        }
        for name, arena in arenas.items()
        if isinstance(arena, Mapping)
    }


def resident_bytes(vram: Mapping[str, Mapping[str, int]]) -> int:
    """VRAM held over all arenas."""
    return sum(int(a.get("resident_bytes") or 0) for a in vram.values())


def service_error(action: str, exc: EngineCommandError) -> ServiceError:
    """The HTTP-facing error for an engine's answer to a level command."""
    what = action.replace("_", " ")
    message = str(exc)
    if exc.code == "not_applicable":
        return ServiceError(400, "not_applicable", f"{what} does not apply: {message}")
    if exc.code == "out_of_memory":
        advice = "" if "retry" in message else "; close other GPU apps and retry"
        return ServiceError(
            503, "insufficient_vram",
            f"{what} failed, the GPU has too little free memory: {message}{advice}",
            retry_after_s=RETRY_AFTER_S)
    if exc.code == "busy":
        return ServiceError(409, "busy", f"{what}: {message}")
    if exc.code in ("bad_request", "not_loaded"):
        return ServiceError(400, exc.code, f"{what} failed: {message}")
    if exc.code in ("engine_crashed", "not_running"):
        return ServiceError(503, "engine_unavailable", f"{what} failed: {message}")
    if exc.code in STORAGE_ADVICE:
        return ServiceError(http_status(exc.code), exc.code,
                            f"{what} failed: {message} ({STORAGE_ADVICE[exc.code]})")
    return ServiceError(http_status(exc.code), exc.code or "internal",
                        f"{what} failed in the engine: {message}",
                        retry_after_s=CODE_RETRY_AFTER_S.get(exc.code or ""))
