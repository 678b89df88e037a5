"""A fake service implementing the facade's control/status, with levels that change its VRAM.

Its status() has the real Service.status() shape (status_schema.ServiceStatus), checked side
by side with the real service in tests/service/test_status_schema.py. FakePool is the model
pool's fake (POOL_CONTRACT.md): status() adds the pool's keys (models, default_model,
vram_budget_bytes), control() takes model=NAME, and it has models_dir and rescan();
tests/app/test_pool_shape.py checks those against the real pool.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.engine.service.facade import ServiceError
from strata.engine.service.service import LevelEvent
from tests.fakes.status import counters, service_status

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
    "refill_experts": "loaded",
    "offload_session": "session_offloaded",
    "sleep": "sleeping",
    "wake": "loaded",
    "unload": "unloaded",
    "load": "loaded",
    "shrink_experts": "loaded",  # the model keeps serving from the partial cache
}


def model_row(name: str, **changes: Any) -> dict[str, Any]:
    """One of the pool's rows (status_schema.ModelRow): an available GGUF, with `changes`."""
    row = {
        "name": name, "aliases": [], "path": f"/models/{name}.gguf", "format": "gguf",
        "size_bytes": GIB // 2, "quantization": "Q4_K", "architecture": "llama",
        "parameter_count": 500_000_000, "context_tokens": 8192, "is_default": False,
        "is_downloaded": True, "state": "available", "is_resident": False, "vram_bytes": 0,
        "load_bytes": GIB, "last_used_s": None,
    }
    unknown = set(changes) - set(row)
    assert not unknown, f"not in the pool's rows: {sorted(unknown)}"
    return {**row, **changes}


# A model's state after a model=NAME action, and whether it then holds its load_bytes.
_ROW_AFTER = {"load": ("loaded", True), "wake": ("loaded", True), "sleep": ("sleeping", False),
              "unload": ("unloaded", False)}


class FakeService:
    """Records control() calls; status() looks like the real Service's, arenas included."""

    def __init__(self, state: str = "loaded", is_moe: bool = True):
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
        self.idle_timeouts: dict[str, float | None] = dict(self.idle)
        self.idle_fired: dict[str, float] = {}
        self.memory_kind = "VRAM"
        self.is_busy = False
        self.is_stopped = False
        self.level_listeners: list = []
        self.state_listeners: list = []  # called on the loop when status() changed, as Service
        self.counters = counters(requests_total=3, prompt_tokens_total=300,
                                 completion_tokens_total=90, cached_tokens_total=128,
                                 tokens_per_second=42.5, last_prompt_tokens=100,
                                 last_completion_tokens=30, finish_reasons={"stop": 3})

    @property
    def model_id(self) -> str:
        return "tiny-moe"

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        if self.is_busy:
            raise ServiceError("busy", "a request is running")
        if action not in _STATE_AFTER:
            raise ServiceError("not_applicable", f"unknown action {action!r}")
        self.calls.append(action)
        self.call_options.append(dict(kwargs))
        held_before = sum(self.resident.values())
        for arena in _FREES.get(action, ()):
            self.released[arena] += self.resident[arena]
            self.resident[arena] = 0
        if action in ("wake", "load", "refill_experts"):
            for arena, num_bytes in self.released.items():
                self.resident[arena] += num_bytes
                self.released[arena] = 0
        self.state = _STATE_AFTER[action]
        self.changed()
        # Service.control()'s answer: the status after, the action, what it freed.
        return {**self.status(), "action": action, "changed": True,
                "freed_bytes": max(0, held_before - sum(self.resident.values()))}

    def changed(self) -> None:
        """Tell the state listeners, as the real lifecycle does after every change."""
        for listener in list(self.state_listeners):
            listener()

    def fire_idle(self, key: str, action: str, timeout_s: float) -> None:
        """What the real lifecycle does when an idle timer fires: go down, tell listeners."""
        for arena in _FREES.get(action, ()):
            self.released[arena] += self.resident[arena]
            self.resident[arena] = 0
        self.state = _STATE_AFTER[action]
        self.idle[key] = None
        self.idle_fired[key] = 0.0
        for listener in self.level_listeners:
            listener(LevelEvent(action, True, f"idle for {timeout_s:g} s"))
        self.changed()

    def status(self) -> dict[str, Any]:
        is_up = self.state not in ("unloaded", "failed")
        levels = {
            "experts": "released" if self.released["experts"] else (
                "resident" if self.resident["experts"] else "none"),
            "session": "offloaded" if self.released["kv"] else "resident",
            "weights": "sleeping" if self.state == "sleeping" else "resident",
        } if is_up else {"experts": "none", "session": "none", "weights": "unloaded"}
        return service_status(
            model=self.model_id,
            state=self.state,
            levels=levels,
            vram={
                a: {"resident_bytes": self.resident[a], "released_bytes": self.released[a]}
                for a in FULL
            } if is_up else {},
            memory_kind=self.memory_kind,
            idle=dict(self.idle),
            idle_timeouts=dict(self.idle_timeouts),
            idle_fired=dict(self.idle_fired),
            queue_length=2,
            is_busy=self.is_busy,
            active_request_id="req-0123456789abcdef" if self.is_busy else None,
            counters=dict(self.counters),
        )


class FakePool(FakeService):
    """The model pool's fake: the default model is the FakeService underneath, `library`
    names the other models, each with a row whose state control(action, model=NAME) moves."""

    def __init__(self, library: tuple[str, ...] = (), models_dir: Path | None = None,
                 **options: Any):
        super().__init__(**options)
        self.rows = {name: model_row(name) for name in library}
        self.models_dir = models_dir or Path("/models")
        self.num_rescans = 0
        self.vram_budget_bytes = 0

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        model = kwargs.get("model")
        if model is not None and model != self.model_id:
            await asyncio.sleep(0)
            return self._control_row(action, model, kwargs)
        result = await super().control(action, **kwargs)
        return {**result, **({"model": model} if model is not None else {})}

    def _control_row(self, action: str, model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A pool's model=NAME action on one of its other models."""
        if model not in self.rows:
            raise ServiceError("model_not_found", f"model '{model}' not found")
        if action not in _ROW_AFTER:
            raise ServiceError("not_applicable", f"{action} of {model} is not faked")
        self.calls.append(action)
        self.call_options.append(dict(kwargs))
        state, holds = _ROW_AFTER[action]
        row = self.rows[model]
        row.update(state=state, is_resident=holds, vram_bytes=row["load_bytes"] if holds else 0,
                   last_used_s=0.0 if holds else row["last_used_s"])
        self.changed()
        return {**self.status(), "action": action, "model": model,
                "results": {model: {"action": action, "changed": True}}}

    async def rescan(self) -> list[dict[str, Any]]:
        """The pool re-reads its models directory; a test adds rows to self.rows first."""
        await asyncio.sleep(0)
        self.num_rescans += 1
        self.changed()
        return self.status()["models"]

    def status(self) -> dict[str, Any]:
        status = super().status()
        is_up = self.state not in ("unloaded", "failed")
        default = model_row(
            self.model_id, is_default=True, state=self.state,
            is_resident=is_up and self.state != "sleeping",
            vram_bytes=sum(self.resident.values()) if is_up else 0,
            load_bytes=sum(FULL.values()), last_used_s=1.0 if is_up else None)
        return {**status, "models": [default, *self.rows.values()],
                "default_model": self.model_id, "vram_budget_bytes": self.vram_budget_bytes}


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
