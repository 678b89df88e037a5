"""levels.allowed_actions: the one decision of which level actions apply now, and why not; and
the typed State, Level and Action every reader uses."""

from __future__ import annotations

import json

from strata.engine import protocol as p
from strata.engine.service.levels import (
    DOWN_ACTIONS,
    SERVICE_STATES,
    Action,
    Level,
    State,
    allowed_actions,
    freed_bytes,
)

GIB = 1 << 30
MOE = {"weights": {"resident_bytes": 4 * GIB, "released_bytes": 0},
       "experts": {"resident_bytes": 10 * GIB, "released_bytes": 0},
       "kv": {"resident_bytes": GIB, "released_bytes": 0}}
DENSE = {"weights": {"resident_bytes": 4 * GIB, "released_bytes": 0},
         "kv": {"resident_bytes": 0, "released_bytes": 0}}


def allowed(state: State, vram=MOE) -> dict[str, tuple[bool, str]]:
    return {str(a): (d.is_allowed, d.reason) for a, d in allowed_actions(state, vram).items()}


def test_a_loaded_moe_may_go_down_every_way():
    got = allowed(State.LOADED)
    for action in ("release_experts", "offload_session", "sleep", "unload"):
        assert got[action] == (True, ""), action
    assert got["refill_experts"][0] is False and got["wake"][0] is False
    assert got["load"] == (False, "the model is loaded")


def test_reasons_say_why_not():
    dense = allowed(State.LOADED, DENSE)
    assert dense["release_experts"] == (False, "dense model: no expert cache")
    assert dense["offload_session"] == (False, "no session in VRAM")
    asleep = allowed(State.SLEEPING)
    assert asleep["wake"] == (True, "") and asleep["unload"] == (True, "")
    assert asleep["release_experts"] == (False, "model is sleeping")
    assert asleep["sleep"] == (False, "nothing loaded to put to sleep")
    assert allowed(State.FAILED)["release_experts"] == (False, "model is error")
    assert allowed(State.UNLOADED, {})["load"] == (True, "")
    assert allowed(State.EXPERTS_RELEASED)["refill_experts"] == (True, "")
    assert allowed(State.SESSION_OFFLOADED)["offload_session"][0] is False


def test_a_running_request_or_a_transition_blocks_everything():
    for state, reason in ((State.BUSY, "a request is running; try again when it is done"),
                          (State.LOADING, "the model is loading"),
                          (State.WAKING, "the model is waking"),
                          (State.STARTING, "the model is starting")):
        assert set(allowed(state).values()) == {(False, reason)}, state
    # Waiting for VRAM: nothing to unload, nothing said about it.
    assert allowed(State.WAITING_FOR_VRAM)["unload"] == (False, "")


def test_the_enums_are_the_words_the_api_answered():
    assert json.dumps({"state": State.SESSION_OFFLOADED, "experts": Level.NONE}) == \
        '{"state": "session_offloaded", "experts": "none"}'
    assert f"{State.LOADED}" == "loaded" and State("busy") is State.BUSY
    assert State.STARTING not in SERVICE_STATES and len(SERVICE_STATES) == 10
    assert [s.health for s in (State.LOADED, State.LOADING, State.FAILED, State.SLEEPING)] == [
        ("ok", 200), ("loading", 503), ("error", 503), ("ok", 200)]
    assert [s.model_status for s in (State.SLEEPING, State.LOADING, State.WAKING)] == [
        "sleeping", "unloaded", "loaded"]
    assert Action.parse("refill") is Action.REFILL_EXPERTS and Action.parse("nope") is None
    assert Action.SLEEP.command is p.Sleep and Action.UNLOAD.is_down
    assert set(DOWN_ACTIONS) == {a for a in Action if a.is_down}


def test_freed_bytes_come_from_the_engine_status_before_and_after():
    def status(kv_bytes: int) -> p.EngineStatus:
        arena = p.ArenaStatus("mapped", 2 * GIB, kv_bytes, 0)
        return p.EngineStatus(p.EngineState.LOADED, 1, arenas={"kv": arena})

    assert freed_bytes(status(GIB), status(0)) == GIB
    assert freed_bytes(status(0), status(GIB)) == 0  # came back: nothing freed
    assert freed_bytes(status(GIB), None) == GIB  # unloaded
