"""The model pool: every model a request may name, one Service (one engine process) per model
in use, created on first use and loaded on demand; under a VRAM budget the other models go down
the levels before one comes up (DESIGN §6b).

One owner decides loads and evictions (STYLE §15, after Ollama's scheduler): every bring-up
goes through bring_up(), which holds one lock while it makes room and brings the model up, so
two models never both count the same free bytes. The pool is also the ServiceFacade of the
default model (the one the server was started with), so a single-model client, the tray and
the rules keep working on it unchanged; model_pool_control.py has the all-model actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from strata.engine import protocol as p
from strata.engine.core.memory.vram import read_free_vram_bytes
from strata.engine.gguf_file import model_path_problem
from strata.engine.service.facade import GenerationRequest, ServiceError
from strata.engine.service.levels import State
from strata.engine.service.load_size import LOAD_WORKSPACE_BYTES
from strata.engine.service.model_pool_control import control_all
from strata.engine.service.model_pool_member import PooledModel
from strata.engine.service.model_pool_names import (
    ModelIndex,
    ModelSpec,
    build_index,
    configured_models,
)
from strata.engine.service.model_pool_room import make_room
from strata.engine.service.model_pool_size import MemberSize, estimate_size
from strata.engine.service.service import LevelEvent, Service
from strata.engine.service.settings import ServeSettings
from strata.engine.service.settings_kinds import SettingsError
from strata.engine.service.status_schema import ModelRow
from strata.paths import snapshot_dir

log = logging.getLogger(__name__)


class ModelNotFound(ServiceError):
    """A request's `model` names no model of the pool (404 in the API's shape)."""

    def __init__(self, name: str, known: Sequence[str]):
        shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
        super().__init__("model_not_found",
                         f"model {name!r} not found; this server has: {shown} (GET /v1/models "
                         "or /api/tags lists them; `strata pull REPO` adds one)")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


class ModelPool:
    """Models by name, each a PooledModel over its own Service; see POOL_CONTRACT."""

    def __init__(self, settings: ServeSettings, models_config: Any = None, *,
                 service_factory: Callable[..., Service] = Service,
                 vram_reader: Callable[[], int | None] = read_free_vram_bytes,
                 estimate: Callable[..., MemberSize] = estimate_size):
        """models_config: the config file's [models] table; service_factory(settings,
        keep_standby=..., vram_reader=...) builds each model's Service (tests pass a fake
        engine through it); estimate(path, is_gpu=, expert_cache=, parameter_count=) sizes a
        model before its engine reports (model_pool_size.estimate_size)."""
        self.settings = settings
        self._configured = configured_models(models_config)  # ModelsConfigError: say it now
        self._make_service = service_factory
        self._reader = vram_reader
        self._estimate = estimate
        self.level_listeners: list[Callable[[LevelEvent], None]] = []
        self.state_listeners: list[Callable[[], None]] = []
        self._members: dict[str, PooledModel] = {}
        self._index: ModelIndex | None = None
        self._sizes: dict[str, MemberSize] = {}
        self._room_lock = asyncio.Lock()  # one bring-up (room, then load/wake) at a time
        # One per model name: creating a member reads its files (tokenizer), and a file that
        # blocks must hold up that model's requests alone, never every other model's.
        self._create_locks: dict[str, asyncio.Lock] = {}
        self._files: frozenset[tuple[str, int]] = frozenset()  # what the last scan saw
        self.taken_down: list[str] = []  # what the last all-model down action took down
        self.is_gpu = False
        self._default_service = self._make_service(settings, vram_reader=vram_reader)
        self._default: PooledModel | None = None

    # ---- where and how much ----------------------------------------------------------------

    @property
    def models_dir(self) -> Path:
        """--models-dir, else the model cache (ServeSettings.library_dir)."""
        return self.settings.library_dir

    @property
    def budget_bytes(self) -> int:
        return int(self.settings.vram_budget_bytes or 0)

    @property
    def workspace_bytes(self) -> int:
        """What a loaded engine holds besides its arenas (CUDA context, cuBLAS)."""
        return LOAD_WORKSPACE_BYTES if self.is_gpu else 0

    async def read_free_vram_bytes(self) -> int | None:
        """Free VRAM now (NVML, off the loop); None where it cannot be read."""
        return await asyncio.to_thread(self._reader)

    @property
    def default(self) -> PooledModel:
        if self._default is None:
            raise ServiceError("not_started", "the service has not started; call start()")
        return self._default

    @property
    def default_name(self) -> str:
        return self._default.name if self._default else self._default_service.model_id

    # ---- lifetime --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the default model (loaded, as a single-model server does), then read the
        library. Raises ServiceError as Service.start does."""
        device = str(self.settings.device)
        if device == "auto":
            self.is_gpu = await asyncio.to_thread(self._reader) is not None
        else:
            self.is_gpu = device.startswith("cuda")
        service = self._default_service
        self._listen(service, lambda: service.model_id)
        await service.start()
        await self.rescan()
        index = self._index
        assert index is not None and index.default is not None
        self._default = PooledModel(self, index.default, service, self._size_of(index.default))
        self._default.last_used_s = time.monotonic()
        self._members[index.default.name] = self._default

    async def stop(self) -> None:
        """End every model's engine process."""
        services = {id(m.service): m.service for m in self._members.values()}
        services[id(self._default_service)] = self._default_service
        results = await asyncio.gather(*(s.stop() for s in services.values()),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("a model's engine did not stop cleanly: %s", result)

    # ---- names -----------------------------------------------------------------------------

    async def rescan(self) -> list[ModelRow]:
        """Read the models directory again (a model pulled since start is then known)."""
        default_path = Path(self._default_service.model_path or "")
        default_name = self._default_service.model_id
        models_dir, configured = self.models_dir, self._configured
        settings, is_gpu, estimate = self.settings, self.is_gpu, self._estimate

        def read() -> tuple[ModelIndex, dict[str, MemberSize]]:
            index = build_index(models_dir, configured, default_path, default_name)
            sizes = {}
            for spec in index.specs:
                if spec.name in self._sizes or not spec.entry.is_downloaded:
                    continue
                sizes[spec.name] = estimate(
                    str(spec.path), is_gpu=is_gpu, expert_cache=settings.expert_cache,
                    parameter_count=spec.entry.parameter_count)
            return index, sizes

        self._files = await asyncio.to_thread(self._library_files)
        index, sizes = await asyncio.to_thread(read)
        self._index = index
        self._sizes.update(sizes)
        self._notify()
        return self.models()

    def _library_files(self) -> frozenset[tuple[str, int]]:
        """The model files under the directory with their mtimes: a listing, no header read."""
        root = self.models_dir
        if not root.is_dir():
            return frozenset()
        found = set()
        for pattern in ("*.gguf", "config.json", "*.safetensors"):
            for path in root.rglob(pattern):
                with contextlib.suppress(OSError):
                    found.add((str(path), path.stat().st_mtime_ns))
        return frozenset(found)

    def _library_changed(self) -> bool:
        """Whether a model file came, went or changed since the last scan. An unknown name
        rescans only then: a client retrying a typo must not read every header each time."""
        return self._library_files() != self._files

    def find(self, name: str | None) -> ModelSpec | None:
        return self._index.find(name) if self._index is not None else None

    async def resolve(self, name: str | None, *, strict: bool = False) -> PooledModel:
        """The model `name` means (None: the default), its Service started (tokenizer read)
        but not loaded: the first request loads it. An unknown name rescans the directory
        once, then gets the default model when it is the only model (as llama.cpp's server
        answers any name: apps hard-code gpt-4o-mini or claude-*) or --model-fallback is
        "default" (unless strict), else raises ModelNotFound."""
        spec = self.find(name)
        if spec is None and await asyncio.to_thread(self._library_changed):
            await self.rescan()
            spec = self.find(name)
        if spec is None:
            is_only_model = self._index is not None and self._index.has_one_model
            if (is_only_model or self.settings.model_fallback == "default") and not strict:
                return self.default
            raise ModelNotFound(str(name), self._index.names if self._index else [])
        return await self._member(spec)

    async def _member(self, spec: ModelSpec) -> PooledModel:
        member = self._members.get(spec.name)
        if member is not None:
            return member
        # A FIFO or device named *.gguf: refused before anything opens it (issue 51).
        problem = await asyncio.to_thread(model_path_problem, spec.path, missing_ok=True)
        if problem is not None:
            raise ServiceError("bad_model", problem)
        async with self._create_locks.setdefault(spec.name, asyncio.Lock()):
            member = self._members.get(spec.name)
            if member is not None:
                return member
            service = self._make_service(self._member_settings(spec), keep_standby=False,
                                         vram_reader=self._reader)
            self._listen(service, lambda: spec.name)
            await service.start(load=False)
            member = PooledModel(self, spec, service, self._size_of(spec))
            self._members[spec.name] = member
            log.info("model %s is known: %s (loads on its first request)", spec.name,
                     spec.path)
            self._notify()
            return member

    def _member_settings(self, spec: ModelSpec) -> ServeSettings:
        """The server's settings for another model: its path and name, its own snapshot
        directory (slot files are per model)."""
        base = Path(self.settings.snapshot_dir or snapshot_dir())
        settings = dataclasses.replace(self.settings, model=str(spec.path),
                                       snapshot_dir=str(base / "models" / _safe(spec.name)))
        try:
            return dataclasses.replace(settings, alias=spec.name)
        except SettingsError:  # a name with white space (a file name): the file's stem serves
            return dataclasses.replace(settings, alias=None)

    def _size_of(self, spec: ModelSpec) -> MemberSize:
        return self._sizes.get(spec.name, MemberSize(0))

    # ---- room and bring-up -----------------------------------------------------------------

    async def bring_up(self, member: PooledModel, action: str | None = None,
                       **kwargs: Any) -> dict[str, Any]:
        """Make room for member (other models go down, least recently used first), then run
        `action` on it (None: load, wake or refill whatever a request needs, skipped when it
        serves already). Raises ServiceError 503 insufficient_vram when it cannot fit."""
        if action is None and member.is_serving():
            return {}
        async with self._room_lock:
            await make_room(self, member)
            member.last_used_s = time.monotonic()
            return await member.service.control(action or "load", **kwargs)

    # ---- events ----------------------------------------------------------------------------

    def _listen(self, service: Service, name: Callable[[], str]) -> None:
        def level(event: LevelEvent) -> None:
            member = self._members.get(name())
            cause = event.cause or (member.eviction_cause if member else None)
            forwarded = dataclasses.replace(event, cause=cause, model=name())
            for listener in list(self.level_listeners):
                try:
                    listener(forwarded)
                except Exception:  # a listener's bug must not fail the level change
                    log.exception("level listener failed")

        service.level_listeners.append(level)
        service.state_listeners.append(self._notify)

    def _notify(self) -> None:
        for listener in list(self.state_listeners):
            try:
                listener()
            except Exception:  # a listener's bug must not fail the service
                log.exception("state listener failed")

    # ---- listing and status ----------------------------------------------------------------

    def models(self) -> list[ModelRow]:
        """Every model with its state and bytes; reads only, never wakes anything."""
        now = time.monotonic()
        rows = []
        for spec in self._index.specs if self._index else []:
            member = self._members.get(spec.name)
            state = member.state() if member else None
            size = member.size if member else self._size_of(spec)
            held = member.held_bytes() if member else 0
            used = member.last_used_s if member else None
            entry = spec.entry
            rows.append(ModelRow(
                name=spec.name, aliases=list(spec.aliases), path=str(spec.path),
                format=entry.format, size_bytes=entry.size_bytes,
                quantization=entry.quantization, architecture=entry.architecture,
                parameter_count=entry.parameter_count, context_tokens=entry.context_tokens,
                is_default=spec.is_default, is_downloaded=entry.is_downloaded,
                state=str(state) if state is not None else "available",
                is_resident=held > 0 and state is not None and state is not State.SLEEPING,
                vram_bytes=held, load_bytes=size.full_bytes,
                last_used_s=None if used is None else round(now - used, 3)))
        return rows

    def member(self, name: str) -> PooledModel | None:
        """The started model called name, if it was started."""
        return self._members.get(name)

    def status(self) -> Any:
        """The default model's status (every key of ServiceStatus) plus every model's row."""
        status = dict(self._default_service.status())
        status.update(models=self.models(), default_model=self.default_name,
                      vram_budget_bytes=self.budget_bytes)
        return status

    # ---- the default model's facade --------------------------------------------------------

    @property
    def text(self) -> Any:
        return self._default_service.text

    @property
    def model_id(self) -> str:
        return self.default_name

    @property
    def model_path(self) -> str | None:
        return self._default_service.model_path

    @property
    def context_tokens(self) -> int:
        return self._default_service.context_tokens

    @property
    def num_slots(self) -> int:
        return self._default_service.num_slots

    @property
    def sampling_defaults(self) -> Any:
        return self._default_service.sampling_defaults

    @property
    def metrics(self) -> Any:
        return self._default_service.metrics

    async def forward_counts(self) -> Any:
        return await self._default_service.forward_counts()

    @property
    def lifecycle(self) -> Any:
        return self._default_service.lifecycle

    @property
    def supervisor(self) -> Any:
        return self._default_service.supervisor

    def memory_kind(self) -> str:
        return self._default_service.memory_kind()

    def generate(self, request: GenerationRequest
                 ) -> AsyncGenerator[p.Tokens | p.Done | p.Error, None]:
        return self.default.generate(request)

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str) -> p.Embeddings:
        return await self.default.embed(token_ids, pooling)

    def set_unload_idle(self, seconds: float | None) -> None:
        self.default.set_unload_idle(seconds)

    async def control(self, action: str, model: str | None = None,
                      **kwargs: Any) -> dict[str, Any]:
        """A level or slot action on `model` (its name), or with model None on every resident
        model going down and on what went down coming back up (model_pool_control.py)."""
        if model is not None:
            member = await self.resolve(model, strict=True)
            return {**await member.control(action, **kwargs), "model": member.name}
        return await control_all(self, action, **kwargs)

    async def load(self, name: str) -> dict[str, Any]:
        return await self.control("load", model=name)

    async def unload(self, name: str) -> dict[str, Any]:
        return await self.control("unload", model=name)

    @property
    def members(self) -> list[PooledModel]:
        return list(self._members.values())
