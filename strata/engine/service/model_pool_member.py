"""One model of the pool: its Service (one engine process) behind the ServiceFacade the routes
use, with the pool making room before anything of it comes back up.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from strata.engine import protocol as p
from strata.engine.service.facade import GenerationRequest, ServiceError, with_load_time
from strata.engine.service.levels import UP_ACTIONS, State
from strata.engine.service.model_pool_names import ModelSpec
from strata.engine.service.model_pool_size import MemberSize, observed_size

if TYPE_CHECKING:  # the Service class is only named here; its module imports torch-free
    from strata.engine.service.service import Service

# Control actions that need the model up first (a slot's save reads its KV).
NEEDS_UP = frozenset({*UP_ACTIONS, "refill", "slot_save", "slot_restore", "slot_erase"})
# States in which nothing needs to come back for a request.
SERVING_STATES = (State.LOADED, State.BUSY, State.SESSION_OFFLOADED)


class Pool(Protocol):
    """What a member and the all-model actions need of the ModelPool (model_pool.py)."""

    is_gpu: bool
    taken_down: list[str]
    settings: Any  # ServeSettings

    @property
    def budget_bytes(self) -> int: ...

    async def read_free_vram_bytes(self) -> int | None: ...

    @property
    def workspace_bytes(self) -> int: ...

    @property
    def default(self) -> PooledModel: ...

    @property
    def members(self) -> list[PooledModel]: ...

    def member(self, name: str) -> PooledModel | None: ...

    async def bring_up(self, member: PooledModel, action: str | None = None,
                       **kwargs: Any) -> dict[str, Any]: ...


class PooledModel:
    """ServiceFacade of one model of a ModelPool."""

    def __init__(self, pool: Pool, spec: ModelSpec, service: Service, size: MemberSize):
        self.pool = pool
        self.spec = spec
        self.service = service
        self.estimate = size  # from the headers, until the engine reports its own
        self.observed: MemberSize | None = None
        self.last_used_s: float | None = None  # monotonic; None: never used
        self.num_requests = 0  # requests that are bringing it up or running on it
        self.eviction_cause: str | None = None  # why the pool is taking it down, if it is

    # ---- facade ----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def model_id(self) -> str:
        return self.spec.name

    @property
    def text(self) -> Any:
        return self.service.text

    @property
    def context_tokens(self) -> int:
        return self.service.context_tokens

    @property
    def num_slots(self) -> int:
        return self.service.num_slots

    @property
    def sampling_defaults(self) -> Any:
        return self.service.sampling_defaults

    @property
    def state_listeners(self) -> list[Callable[[], None]]:
        return self.service.state_listeners

    @property
    def metrics(self) -> Any:
        return self.service.metrics

    async def forward_counts(self) -> Any:
        return await self.service.forward_counts()

    @property
    def settings(self) -> Any:
        return self.service.settings

    def status(self) -> Any:
        return self.service.status()

    def set_unload_idle(self, seconds: float | None) -> None:
        """This model's keep-alive (Ollama's keep_alive, a request's ttl)."""
        self.service.set_unload_idle(seconds)

    async def generate(self, request: GenerationRequest
                       ) -> AsyncGenerator[p.Tokens | p.Done | p.Error, None]:
        """Service.generate, after the pool made room and brought the model up."""
        self.num_requests += 1
        try:
            began_s = time.monotonic()
            await self.pool.bring_up(self)
            request, with_load = with_load_time(request, time.monotonic() - began_s)
            async with aclosing(self.service.generate(request)) as events:
                async for event in events:
                    yield with_load(event)
        finally:
            self._used()

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str) -> p.Embeddings:
        self.num_requests += 1
        try:
            await self.pool.bring_up(self)
            return await self.service.embed(token_ids, pooling)
        finally:
            self._used()

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        """Service.control; an action that brings the model back makes room first."""
        if action not in NEEDS_UP:
            return await self.service.control(action, **kwargs)
        self.num_requests += 1
        try:
            if action.startswith("slot_"):
                await self.pool.bring_up(self)
                return await self.service.control(action, **kwargs)
            return await self.pool.bring_up(self, action, **kwargs)
        finally:
            self._used()

    # ---- what the pool reads ---------------------------------------------------------------

    def state(self) -> State | None:
        """The model's State; None until an engine process was started for it (its tokenizer
        may have been read: state "available")."""
        try:
            state = self.service.lifecycle.state()
        except ServiceError:  # not started
            return None
        if state is State.UNLOADED and self.service.supervisor.num_starts == 0:
            return None
        return state

    @property
    def size(self) -> MemberSize:
        """Bytes once loaded: the engine's own account once it reported one, else the estimate."""
        try:
            vram = self.service.lifecycle.vram()
        except ServiceError:  # not started
            vram = {}
        if vram:
            seen = observed_size(vram)
            if seen is not None:
                workspace = self.pool.workspace_bytes
                self.observed = MemberSize(seen.full_bytes + workspace, seen.expert_bytes)
        if self.observed is None or self.observed.full_bytes < self.estimate.full_bytes:
            return self.estimate  # an engine that has not grown its KV yet reports less
        return self.observed

    def held_bytes(self) -> int:
        return self.size.held_bytes(self.state(), is_gpu=self.pool.is_gpu)

    @property
    def is_busy(self) -> bool:
        """Serving, about to serve, or in the middle of a level change: never a victim."""
        if self.num_requests > 0:
            return True
        state = self.state()
        if state is None:
            return False
        return self.service.lifecycle.is_busy or state in (
            State.BUSY, State.LOADING, State.WAKING, State.WAITING_FOR_VRAM)

    def is_serving(self) -> bool:
        return self.state() in SERVING_STATES

    def _used(self) -> None:
        self.num_requests -= 1
        self.last_used_s = time.monotonic()
