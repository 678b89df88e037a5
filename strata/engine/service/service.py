"""The Service: what the API and the tray talk to (ServiceFacade), over the Supervisor.

Generations run up to `parallel` at once behind one FIFO, which level changes share and run
alone in (engine/service/admission.py); each request brings back what it needs first (load,
wake, refill). Text assets (tokenizer, chat template) are loaded on the
host, so tokenizing works while the engine is unloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.default_model import (
    DEFAULT_MODEL_FILENAME,
    DEFAULT_MODEL_SAMPLING,
    resolve_model_path,
)
from strata.engine import protocol as p
from strata.engine.core.memory.vram import read_free_vram_bytes
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from strata.engine.gguf_file import model_path_problem
from strata.engine.protocol import Done, Error, PromptProgress, Tokens
from strata.engine.service.before_load import DEFAULT_TIMEOUT_S, BeforeLoadHook
from strata.engine.service.engine_handle import EngineCommandError
from strata.engine.service.facade import GenerationRequest, ServiceError, with_load_time
from strata.engine.service.levels import DOWN_ACTIONS, UP_ACTIONS, Action, State
from strata.engine.service.lifecycle import IDLE_TIMERS, Lifecycle, slot_row
from strata.engine.service.lifecycle_return import engine_level_error
from strata.engine.service.metrics import ServiceMetrics
from strata.engine.service.settings import ServeSettings, engine_config_for
from strata.engine.service.status_schema import ServiceStatus
from strata.engine.service.supervisor import Supervisor
from strata.engine.service.vram_guard import FreeVramReader, VramGuard
from strata.engine.text.sampling_defaults import (
    SAMPLING_FIELDS,
    SamplingDefaults,
    read_model_sampling,
    resolve_sampling_defaults,
)
from strata.engine.triton_support import gpu_kernel_notice

log = logging.getLogger(__name__)

SLOT_COMMANDS = {"slot_save": p.SaveSlot, "slot_restore": p.RestoreSlot, "slot_erase": p.EraseSlot}
ACTIONS = (*UP_ACTIONS, *DOWN_ACTIONS, *SLOT_COMMANDS, "slots")


@dataclass(frozen=True)
class LevelEvent:
    """A level change that happened: the action, whether it worked, and its cause when the
    service went down by itself (an idle timer: "idle for 300 s"); None when asked."""

    action: str
    is_ok: bool
    cause: str | None = None
    model: str | None = None  # the model's name when a ModelPool passes it on


def _load_text_assets(model_path: str) -> Any:
    from strata.engine.text import load_text_assets  # host-side, torch-free

    return load_text_assets(model_path)


def model_sampling_defaults(settings: ServeSettings, model_path: str | None) -> SamplingDefaults:
    """The settings' sampling values over the model file's, over llama.cpp's; the embedded
    default model's file declares none, so Strata's own choice for it stands in."""
    configured = {name: getattr(settings, name) for name in SAMPLING_FIELDS}
    try:
        model_values = read_model_sampling(model_path)
    except (ValueError, OSError):  # an unreadable file fails the load with its own message
        model_values = {}
    source = "model"
    if not model_values and model_path and Path(model_path).name == DEFAULT_MODEL_FILENAME:
        model_values, source = dict(DEFAULT_MODEL_SAMPLING), "strata (embedded default model)"
    return resolve_sampling_defaults(model_values, configured, source)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Service:
    """ServiceFacade over a real engine process (or a test engine through the same process)."""

    def __init__(
        self,
        settings: ServeSettings,
        *,
        engine_factory: str = DEFAULT_ENGINE_FACTORY,
        engine_config: Any = None,
        text_assets: Any = None,
        text_loader: Callable[[str], Any] = _load_text_assets,
        supervisor_options: dict[str, Any] | None = None,
        vram_reader: FreeVramReader = read_free_vram_bytes,
        before_load_timeout_s: float = DEFAULT_TIMEOUT_S,
        keep_standby: bool | None = None,
    ):
        """engine_config: what the factory is built with (default: an EngineConfig from the
        settings); text_assets: preloaded TextAssets, else text_loader(model_path) in start().
        vram_reader: free VRAM in bytes or None (NVML by default), for the free-VRAM guard.
        keep_standby: after an unload, keep a process with the engine imported for the next
        load (default: the settings' standby_process, else on)."""
        self.settings = settings
        self.metrics = ServiceMetrics()
        # Called on the service loop after every level change, by whoever asked or by an idle
        # timer (cause says which): the tray logs the ones nobody clicked.
        self.level_listeners: list[Callable[[LevelEvent], None]] = []
        # Called on the service loop whenever status() may have changed (a level, a request
        # starting or ending, the engine process): the tray re-reads status() then.
        self.state_listeners: list[Callable[[], None]] = []
        self._vram_reader = vram_reader
        self._has_gpu: bool | None = None  # asked once, for the memory word of "auto"
        self._engine_factory = engine_factory
        self._engine_config = engine_config
        self._text = text_assets
        self._text_loader = text_loader
        self._supervisor_options = dict(supervisor_options or {})
        self._model_path: str | None = settings.model or getattr(engine_config, "model_path", None)
        self._supervisor: Supervisor | None = None
        self._lifecycle: Lifecycle | None = None
        self._guard = VramGuard(settings.min_free_vram_mib, settings.vram_wait_s, reader=vram_reader)
        self._hook = BeforeLoadHook(settings.before_load, timeout_s=before_load_timeout_s,
                                    is_required=settings.before_load_required)
        if keep_standby is None:
            keep_standby = bool(getattr(settings, "standby_process", True))
        self._keep_standby = keep_standby
        self._sampling_defaults: SamplingDefaults | None = None

    # ---- facade properties -----------------------------------------------------------------

    @property
    def text(self) -> Any:
        """TextAssets of the configured model; loaded by start(), usable while unloaded."""
        if self._text is None:
            raise ServiceError("not_started", "the service has not started; call start()")
        return self._text

    @property
    def model_id(self) -> str:
        """The served model's name: --alias, else its file or directory name."""
        if self.settings.alias:
            return self.settings.alias
        if not self._model_path:
            return "default"
        path = Path(self._model_path)
        return path.stem if path.suffix == ".gguf" else path.name

    @property
    def model_path(self) -> str | None:
        """The model file or directory, once resolved (start() resolves the default model)."""
        return self._model_path

    @property
    def context_tokens(self) -> int:
        info = self._supervisor.load_info if self._supervisor else None
        if info and info.get("context_tokens"):
            return int(info["context_tokens"])
        return self.settings.context_tokens

    @property
    def num_slots(self) -> int:
        """Cache slots of the model, 0..num_slots-1: what the engine runs with (--slots)."""
        if self._engine_config is not None:
            return int(self._engine_config.num_slots)
        return self.settings.slots

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What requests that leave sampling fields out get: settings, model, llama.cpp."""
        if self._sampling_defaults is None:
            self._sampling_defaults = model_sampling_defaults(self.settings, self._model_path)
        return self._sampling_defaults

    @property
    def supervisor(self) -> Supervisor:
        if self._supervisor is None:
            raise ServiceError("not_started", "the service has not started; call start()")
        return self._supervisor

    @property
    def lifecycle(self) -> Lifecycle:
        if self._lifecycle is None:
            raise ServiceError("not_started", "the service has not started; call start()")
        return self._lifecycle

    # ---- lifetime --------------------------------------------------------------------------

    async def start(self, *, load: bool = True) -> None:
        """Resolve the model, load its text assets, spawn the engine and load the model
        (load=False: everything but the load, which the first request or `load` does).

        Raises ServiceError when the model cannot be used at all (missing default model,
        unreadable tokenizer). An engine that fails to load leaves the service up in the
        "failed" state (status says why); the next request tries again.
        """
        loop = asyncio.get_running_loop()
        if self._model_path is None:
            try:
                self._model_path = await loop.run_in_executor(None, resolve_model_path, None)
            except (RuntimeError, OSError) as exc:  # DefaultModelError is a RuntimeError
                raise ServiceError("model_unavailable", _one_line(exc)) from None
        # A FIFO or a device named as the model: every later open would block (issue 51).
        problem = await asyncio.to_thread(model_path_problem, self._model_path,
                                          missing_ok=True)
        if problem is not None:
            raise ServiceError("bad_model", problem)
        if self._text is None:
            try:
                self._text = await loop.run_in_executor(None, self._text_loader, self._model_path)
            except (ValueError, OSError) as exc:  # TextAssetsError is a ValueError
                raise ServiceError("bad_model", f"cannot read the tokenizer of {self._model_path}: "
                    f"{_one_line(exc)}"
                ) from None
        if self._sampling_defaults is None:  # reads the model file: off the event loop
            self._sampling_defaults = await loop.run_in_executor(
                None, model_sampling_defaults, self.settings, self._model_path)
        if self._engine_config is None:
            self._engine_config = await loop.run_in_executor(
                None, engine_config_for, self.settings, self._model_path
            )
        if self._supervisor is None:
            options = {"ready_timeout_s": self.settings.engine_start_timeout_s,
                       **self._supervisor_options}
            self._supervisor = Supervisor(
                self._engine_config, self._engine_factory, **options
            )
            self._lifecycle = Lifecycle(
                self._supervisor,
                {key: getattr(self.settings, field) for key, field, _ in IDLE_TIMERS},
                guard=self._guard, hook=self._hook, keep_standby=self._keep_standby,
                on_change=self._level_changed, parallel=self._engine_config.num_parallel,
                max_queue=self.settings.max_queue,
            )
            self._lifecycle.state_listeners.append(self._state_changed)
        if not load:
            self.lifecycle.start_timers()
            return
        try:
            await self.lifecycle.level_action(Action.LOAD)
        except ServiceError as exc:
            if exc.code == "insufficient_vram":  # working as designed: it loads when VRAM frees
                log.info("the model waits for VRAM: %s", exc.message)
            else:
                log.error("the engine did not come up: %s", exc.message)
        self.lifecycle.start_timers()

    async def stop(self) -> None:
        """Stop the idle timers, end the engine process (cancelling what runs) and the standby."""
        if self._lifecycle is not None:
            await self._lifecycle.stop()

    # ---- generation ------------------------------------------------------------------------

    def _check_request(self, request: GenerationRequest) -> None:
        prompt, sampling = request.prompt_ids, request.sampling
        vocab_size = getattr(self._text, "vocab_size", None)
        problem = None
        if not prompt:
            problem = "the prompt is empty: send at least one token"
        elif any(not isinstance(t, int) or t < 0 for t in prompt):
            problem = "token ids must be non-negative integers"
        elif vocab_size and max(prompt) >= vocab_size:
            problem = f"token id {max(prompt)} is outside the vocabulary (0..{vocab_size - 1})"
        elif self.context_tokens and len(prompt) >= self.context_tokens:
            problem = (f"the prompt is {len(prompt)} tokens but the context is "
                       f"{self.context_tokens}; shorten it or start with a larger --context")
        elif sampling.max_tokens < 1:
            problem = f"max_tokens must be >= 1, not {sampling.max_tokens}"
        elif request.slot is not None:
            problem = p.slot_problem(request.slot, self.num_slots)
        if problem:
            self.metrics.num_rejected += 1
            raise ServiceError("bad_request", problem)

    async def generate(self, request: GenerationRequest
                       ) -> AsyncGenerator[Tokens | Done | Error | PromptProgress, None]:
        """Queue a generation at the gate; bring the engine up first; yield its events.

        Raises ServiceError before any event when the request is invalid (400), the queue is
        full (503 queue_full, with Retry-After) or the engine cannot come up (503). Closing the
        iterator early cancels the generation and waits for the engine to confirm.
        """
        supervisor, lifecycle = self.supervisor, self.lifecycle
        self._check_request(request)
        request_id = f"req-{uuid.uuid4().hex[:16]}"
        clock = self.metrics.start_request()  # from arrival: the queue wait counts
        began_s = time.monotonic()
        try:
            await lifecycle.begin_request(request_id)  # load / wake / refill first
        except ServiceError:
            self.metrics.num_rejected += 1
            raise
        request, with_load = with_load_time(request, time.monotonic() - began_s)
        try:
            def on_end(final: Done | Error | None) -> None:
                self.metrics.record(final, clock)
                if request.on_final is not None:
                    request.on_final(final)

            events = supervisor.stream(
                request_id, request.prompt_ids, request.sampling, request.slot, on_end=on_end
            )
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, Tokens):
                        clock.tokens(len(event.token_ids))
                    yield with_load(event)
        finally:
            await lifecycle.end_request(request_id)

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str) -> p.Embeddings:
        """Embed each token sequence (protocol.Embed), bringing the engine up first as a
        generation does; it holds a place at the gate as one. The engine runs it a few
        sequences at a time beside the generations; a caller cancelled meanwhile (its client
        left) cancels it in the engine, which goes on serving. Raises ServiceError: 400 for a
        bad input, 503 when the engine cannot come up or fails."""
        sequences = tuple(tuple(ids) for ids in token_ids)
        if not sequences or not all(sequences):  # the engine checks ids and lengths
            self.metrics.num_rejected += 1
            raise ServiceError("bad_request", "nothing to embed: every input needs a token")
        lifecycle = self.lifecycle
        request_id = f"embed-{uuid.uuid4().hex[:16]}"
        try:
            await lifecycle.begin_request(request_id)
        except ServiceError:
            self.metrics.num_rejected += 1
            raise
        vectors: list[tuple[float, ...]] = []
        try:
            async with aclosing(self.supervisor.embed(request_id, sequences, pooling)) as events:
                async for event in events:
                    if isinstance(event, p.Embeddings):
                        vectors.extend(event.vectors)
                    elif isinstance(event, Error):
                        raise engine_level_error(
                            "embed", EngineCommandError(event.code, event.message))
                    elif isinstance(event, Done) and event.usage.finish_reason != "stop":
                        # the server is stopping the engine: no partial answer
                        raise ServiceError("cancelled", "the embedding was cancelled: the "
                                           "engine is stopping; retry")
                    elif isinstance(event, Done):
                        self.metrics.record_embedding(event.usage)
            return p.Embeddings(request_id, tuple(vectors), sum(map(len, sequences)))
        finally:
            await lifecycle.end_request(request_id)

    async def forward_counts(self) -> p.ForwardCounts | None:
        """The engine's forward calls since the model's load, asked now; None while no engine
        runs. Wakes nothing."""
        return await self._lifecycle.read_forwards() if self._lifecycle is not None else None

    # ---- control and status ----------------------------------------------------------------

    def set_unload_idle(self, seconds: float | None) -> None:
        """Unload after this many idle seconds from now on (None: never); Ollama's keep_alive."""
        self.settings = dataclasses.replace(self.settings, idle_unload_s=seconds)
        if self._lifecycle is not None:
            self._lifecycle.set_idle_timeout("unload", seconds)

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        """A lifecycle action: load, unload, sleep, wake, release_experts, refill_experts
        (refill), offload_session, restore_session; slot_save/slot_restore (slot, filename),
        slot_erase (slot); slots (a read: the slots now, waking nothing).

        Raises ServiceError: 409 busy (going down while a request runs), 400 not_applicable
        (with the reason), 503 when the model cannot come back (Retry-After when VRAM is short).
        """
        lifecycle = self.lifecycle
        if action == "slots":
            return {"action": "slots", "slots": await lifecycle.read_slots()}
        if action in SLOT_COMMANDS:
            command = _slot_command(action, kwargs, self.num_slots)
            result = await lifecycle.slot_action(action, command)
            return {"action": action, "result": result, **self.status()}
        level = Action.parse(action)
        if level is None:
            raise ServiceError("not_applicable",
                               f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
        options = _level_options(level, kwargs)
        result = await lifecycle.level_action(level, **options)
        return {**self.status(), **result}

    def _level_changed(self, action: str, is_ok: bool, cause: str | None = None) -> None:
        self.metrics.record_level(action, is_ok)
        event = LevelEvent(action, is_ok, cause)
        for listener in list(self.level_listeners):
            try:
                listener(event)
            except Exception:  # a listener's bug must not fail the level change
                log.exception("level listener failed")

    def _parallel(self) -> int:
        config = self._engine_config
        return int(config.num_parallel) if config is not None else (
            self.settings.parallel or self.settings.slots)

    def _state_changed(self) -> None:
        for listener in list(self.state_listeners):
            try:
                listener()
            except Exception:  # a listener's bug must not fail the service
                log.exception("state listener failed")

    def memory_kind(self) -> str:
        """"VRAM" where the engine runs (or would run) on a GPU, "RAM" on the CPU."""
        engine = self._lifecycle.engine if self._lifecycle else None
        device = str(engine.device if engine is not None and engine.device
                     else self.settings.device)
        if device == "auto":
            if self._has_gpu is None:
                self._has_gpu = self._vram_reader() is not None
            device = "cuda" if self._has_gpu else "cpu"
        return "VRAM" if device.startswith("cuda") else "RAM"

    def kernel_notice(self, model_info: dict[str, Any] | None) -> str | None:
        """Why GGUF blocks are (or will be) expanded on the GPU: the loaded engine's own word,
        else the host's forecast for a GPU load (triton_support.py); None on the CPU."""
        if model_info:
            return model_info.get("kernel_notice")
        return gpu_kernel_notice("cuda") if self.memory_kind() == "VRAM" else None

    def status(self) -> ServiceStatus:
        """A snapshot for /v1/status, /health and /metrics; reads only what the last request or
        level change left behind: it never wakes anything or restarts an idle clock. Its shape
        is status_schema.ServiceStatus, which the test fakes follow too."""
        supervisor_status = self._supervisor.status() if self._supervisor else {}
        lifecycle = self._lifecycle
        engine = lifecycle.engine if lifecycle and lifecycle.is_up() else None
        slots = [slot_row(slot) for slot in engine.slots] if engine is not None else []
        return {
            "state": lifecycle.state() if lifecycle else State.UNLOADED,
            "levels": lifecycle.levels().as_dict() if lifecycle else None,
            "vram": lifecycle.vram() if lifecycle else {},
            "memory_kind": self.memory_kind(),
            "idle": lifecycle.idle_countdowns() if lifecycle else {},
            "idle_timeouts": {key: getattr(self.settings, field) for key, field, _ in IDLE_TIMERS},
            "idle_fired": lifecycle.idle_fired() if lifecycle else {},
            "model": self.model_id,
            "model_path": self._model_path,
            "context_tokens": self.context_tokens,
            "queue_length": lifecycle.num_waiting if lifecycle else 0,
            "batch": {"running": lifecycle.num_running if lifecycle else 0,
                      "waiting": lifecycle.num_waiting if lifecycle else 0,
                      "parallel": lifecycle.gate.parallel if lifecycle else self._parallel(),
                      "max_queue": self.settings.max_queue, "num_slots": self.num_slots},
            "is_busy": lifecycle.is_busy if lifecycle else False,
            "active_request_id": lifecycle.active_request_id if lifecycle else None,
            "engine_pid": supervisor_status.get("pid"),
            "engine": {
                "pid": supervisor_status.get("pid"),
                "state": supervisor_status.get("state", "unloaded"),
                "standby_pid": supervisor_status.get("standby_pid"),
                "engine_state": engine_state(lifecycle.engine) if lifecycle else None,
                "model_info": supervisor_status.get("engine"),
            },
            "slots": slots or None,
            "experts": engine.experts if engine is not None else None,
            "last_error": (lifecycle.last_error if lifecycle else None)
            or supervisor_status.get("last_error"),
            "last_hook": self._hook.status(),
            "free_vram_bytes": self._guard.last_free_bytes,
            "kernel_notice": self.kernel_notice(supervisor_status.get("engine")),
            "waiting_for_vram": lifecycle.waiting_for_vram if lifecycle else None,
            "retry_in_s": supervisor_status.get("retry_in_s", 0.0),
            "engine_starts": supervisor_status.get("num_starts", 0),
            "engine_crashes": supervisor_status.get("num_crashes", 0),
            "counters": self.metrics.snapshot(),
        }


def engine_state(engine: p.EngineStatus | None) -> str | None:
    """The engine's own last word (loaded | sleeping); None when it holds no model."""
    if engine is None or engine.state is p.EngineState.STANDBY:
        return None
    return engine.state


def _level_options(action: Action, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The options a level action takes (the rules pass them): vram_wait_s on the way up,
    keep_sessions on unload; anything else is a 400 naming it."""
    allowed = {"unload": {"keep_sessions"}, "shrink_experts": {"keep_free_mib"}}.get(
        action, {"vram_wait_s"} if action in UP_ACTIONS else set())
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ServiceError("bad_request",
                           f"{action} does not take {', '.join(unknown)}")
    wait_s = kwargs.get("vram_wait_s")
    if wait_s is not None and (isinstance(wait_s, bool) or not isinstance(wait_s, (int, float))
                               or wait_s < 0):
        raise ServiceError("bad_request", f"vram_wait_s must be >= 0 s, got {wait_s!r}")
    keep_free_mib = kwargs.get("keep_free_mib", 0 if action != "shrink_experts" else None)
    if isinstance(keep_free_mib, bool) or not isinstance(keep_free_mib, int) or keep_free_mib < 0:
        raise ServiceError("bad_request", "shrink_experts needs keep_free_mib, the MiB of "
                           f"VRAM to keep free (an integer >= 0), got {keep_free_mib!r}")
    if not isinstance(kwargs.get("keep_sessions", False), bool):
        raise ServiceError("bad_request", "keep_sessions must be true or false")
    return dict(kwargs)


def _slot_command(action: str, kwargs: dict[str, Any], num_slots: int) -> Any:
    """The engine command for a slot action, its arguments checked (400 when wrong)."""
    slot = kwargs.get("slot")
    problem = p.slot_problem(slot, num_slots)
    if problem:
        raise ServiceError("bad_request", f"{action}: {problem}")
    assert isinstance(slot, int)  # slot_problem passes only ints
    if action == "slot_erase":
        return p.EraseSlot(slot)
    filename = kwargs.get("filename")
    if p.filename_problem(filename) is not None:
        raise ServiceError("bad_request",
                           f"{action} needs a plain file name in the snapshot directory, "
                           f"got {filename!r}")
    return SLOT_COMMANDS[action](slot, filename)
