"""One status() of the real shape (status_schema.ServiceStatus) for every fake service.

Fakes start from service_status() and change what they model, so a key the real Service adds
reaches every fake here, and tests/service/test_status_schema.py compares them side by side.
"""

from __future__ import annotations

from typing import Any

from strata.engine.service.latency import LatencyHistograms

IDLE_KEYS = ("cache_release", "session_offload", "sleep", "unload")


def counters(**changes: Any) -> dict[str, Any]:
    """ServiceMetrics.snapshot() of a service that has served nothing, with `changes`."""
    return {
        "requests_total": 0, "rejected_total": 0, "prompt_tokens_total": 0,
        "completion_tokens_total": 0, "cached_tokens_total": 0, "evaluated_tokens_total": 0,
        "prefill_seconds_total": 0.0, "decode_seconds_total": 0.0, "max_sequence_tokens": 0,
        "tokens_per_second": 0.0,
        "last_prompt_tokens": 0, "last_completion_tokens": 0, "finish_reasons": {},
        "errors": {}, "level_changes": {}, "level_failures": {},
        **LatencyHistograms().snapshot(), **changes,
    }


def service_status(*, model: str, state: str = "loaded", **changes: Any) -> dict[str, Any]:
    """A loaded (or, by state, unloaded/failed) service's status, with `changes` applied."""
    is_up = state not in ("unloaded", "failed")
    status = {
        "state": state,
        "levels": {"experts": "none", "session": "none", "weights": "resident"} if is_up
        else {"experts": "none", "session": "none", "weights": "unloaded"},
        "vram": {},
        "memory_kind": "RAM",
        "idle": dict.fromkeys(IDLE_KEYS),
        "idle_timeouts": dict.fromkeys(IDLE_KEYS),
        "idle_fired": {},
        "model": model,
        "model_path": f"/models/{model}.gguf",
        "context_tokens": 4096,
        "queue_length": 0,
        "batch": {"running": 0, "waiting": 0, "parallel": 4, "max_queue": 64, "num_slots": 4},
        "is_busy": False,
        "active_request_id": None,
        "engine_pid": 4242 if is_up else None,
        "engine": {"pid": 4242 if is_up else None, "state": "loaded" if is_up else state,
                   "standby_pid": None, "engine_state": "loaded" if is_up else None,
                   "model_info": {"model_type": "llama", "device": "cpu"} if is_up else None},
        "slots": None,
        "experts": None,
        "last_error": None,
        "kernel_notice": None,
        "waiting_for_vram": None,
        "last_hook": None,
        "free_vram_bytes": None,
        "retry_in_s": 0.0,
        "engine_starts": 1,
        "engine_crashes": 0,
        "counters": counters(),
    }
    unknown = set(changes) - set(status)
    assert not unknown, f"not in the real status: {sorted(unknown)}"
    if "batch" not in changes:  # a fake that says it is busy or has a queue: the batch agrees
        status["batch"] = {**status["batch"], "waiting": changes.get("queue_length", 0),
                           "running": int(bool(changes.get("is_busy")))}
    return {**status, **changes}
