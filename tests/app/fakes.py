"""A fake service implementing the facade's control/status, with levels that change its VRAM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from strata.engine.service.facade import ServiceError

GIB = 1024**3
FULL = {"weights": 4 * GIB, "experts": 10 * GIB, "kv": 1 * GIB}
_FREES = {
    "release_experts": ("experts",),
    "offload_session": ("kv",),
    "sleep": ("weights", "experts", "kv"),
    "unload": ("weights", "experts", "kv"),
}
_STATE_AFTER = {
    "release_experts": "experts_released",
    "refill_experts": "serving",
    "offload_session": "session_offloaded",
    "sleep": "sleeping",
    "wake": "serving",
    "unload": "unloaded",
    "load": "serving",
    "shrink_experts": "serving",  # the model keeps serving from the partial cache
}


class FakeService:
    """Records control() calls; status() looks like the real Service's, arenas included."""

    def __init__(self, state: str = "serving", is_moe: bool = True):
        self.state = state
        self.calls: list[str] = []
        self.call_options: list[dict[str, Any]] = []  # control()'s keyword arguments, per call
        self.resident = dict(FULL) if is_moe else {"weights": 4 * GIB, "experts": 0, "kv": GIB}
        self.released = {k: 0 for k in FULL}
        self.idle: dict[str, float | None] = {
            "cache_release": None,
            "session_offload": None,
            "sleep": None,
            "unload": None,
        }
        self.is_busy = False
        self.is_stopped = False

    @property
    def model_id(self) -> str:
        return "tiny-moe"

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.is_busy:
            raise ServiceError(409, "busy", "a request is running")
        if action not in _STATE_AFTER:
            raise ServiceError(400, "not_applicable", f"unknown action {action!r}")
        self.calls.append(action)
        self.call_options.append(dict(kwargs))
        for arena in _FREES.get(action, ()):
            self.released[arena] += self.resident[arena]
            self.resident[arena] = 0
        if action in ("wake", "load", "refill_experts"):
            for arena, num_bytes in self.released.items():
                self.resident[arena] += num_bytes
                self.released[arena] = 0
        self.state = _STATE_AFTER[action]
        return {"action": action}

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "model": self.model_id,
            "is_busy": self.is_busy,
            "vram": {
                a: {"resident_bytes": self.resident[a], "released_bytes": self.released[a]}
                for a in FULL
            },
            "idle": dict(self.idle),
            "queue_length": 2,
            "tokens_per_s": 42.5,
            "cached_tokens": 128,
            "last_error": None,
        }


@dataclass
class FakeRunningServer:
    service: FakeService
    endpoint_url: str = "http://127.0.0.1:5555/v1"
    stops: list[str] = field(default_factory=list)

    async def stop(self) -> None:
        self.service.is_stopped = True
        self.stops.append("stopped")


def factory_for(service: FakeService):
    """A ServerFactory that 'starts' the fake service."""

    async def factory(settings: Any) -> FakeRunningServer:
        return FakeRunningServer(service)

    return factory
