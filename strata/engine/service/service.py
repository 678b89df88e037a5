"""The Service: what the API and the tray talk to (ServiceFacade), over the Supervisor.

One generation lane, FIFO: requests queue on an asyncio.Lock (which wakes waiters in arrival
order) and each brings the engine up first if it is down. Text assets (tokenizer, chat
template) are loaded on the host, so tokenizing works while the engine is unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from strata.engine.protocol import Done, Error, Tokens
from strata.engine.service.facade import GenerationRequest, ServiceError
from strata.engine.service.metrics import ServiceMetrics
from strata.engine.service.settings import ServeSettings
from strata.engine.service.supervisor import EngineUnavailable, Supervisor

log = logging.getLogger(__name__)

NUM_CACHE_SLOTS = 4
# Actions the lifecycle work will add; until then they answer 400 not_applicable.
LATER_ACTIONS = (
    "sleep", "wake", "release_experts", "refill_experts", "offload_session", "restore_session",
    "slot_save", "slot_restore", "slot_erase",
)


def _load_text_assets(model_path: str) -> Any:
    from strata.engine.text import load_text_assets  # host-side, torch-free

    return load_text_assets(model_path)


def _build_engine_config(settings: ServeSettings, model_path: str) -> Any:
    # Imported here: engine.py imports torch, which the host needs only when it builds this.
    from strata.engine.core.engine_config import EngineConfig

    return EngineConfig(model_path=model_path, device=settings.device,
                        context_tokens=settings.context_tokens)


def _resolve_default_model() -> str:
    from strata.default_model import default_model_path

    return str(default_model_path(fetch=True))


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
    ):
        """engine_config: what the factory is built with (default: an EngineConfig from the
        settings); text_assets: preloaded TextAssets, else text_loader(model_path) in start()."""
        self.settings = settings
        self.metrics = ServiceMetrics()
        self._engine_factory = engine_factory
        self._engine_config = engine_config
        self._text = text_assets
        self._text_loader = text_loader
        self._supervisor_options = dict(supervisor_options or {})
        self._model_path: str | None = settings.model or getattr(engine_config, "model_path", None)
        self._supervisor: Supervisor | None = None
        self._lane = asyncio.Lock()
        self._num_waiting = 0
        self._active_request_id: str | None = None

    # ---- facade properties -----------------------------------------------------------------

    @property
    def text(self) -> Any:
        """TextAssets of the configured model; loaded by start(), usable while unloaded."""
        if self._text is None:
            raise ServiceError(503, "not_started", "the service has not started; call start()")
        return self._text

    @property
    def model_id(self) -> str:
        if not self._model_path:
            return "default"
        path = Path(self._model_path)
        return path.stem if path.suffix == ".gguf" else path.name

    @property
    def context_tokens(self) -> int:
        info = self._supervisor.load_info if self._supervisor else None
        if info and info.get("context_tokens"):
            return int(info["context_tokens"])
        return self.settings.context_tokens

    @property
    def supervisor(self) -> Supervisor:
        if self._supervisor is None:
            raise ServiceError(503, "not_started", "the service has not started; call start()")
        return self._supervisor

    # ---- lifetime --------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the model, load its text assets, spawn the engine and load the model.

        Raises ServiceError when the model cannot be used at all (missing default model,
        unreadable tokenizer). An engine that fails to load leaves the service up in the
        "failed" state (status says why); the next request tries again.
        """
        loop = asyncio.get_running_loop()
        if self._model_path is None:
            try:
                self._model_path = await loop.run_in_executor(None, _resolve_default_model)
            except (RuntimeError, OSError) as exc:  # DefaultModelError is a RuntimeError
                raise ServiceError(503, "model_unavailable", _one_line(exc)) from None
        if self._text is None:
            try:
                self._text = await loop.run_in_executor(None, self._text_loader, self._model_path)
            except (ValueError, OSError) as exc:  # TextAssetsError is a ValueError
                raise ServiceError(
                    400, "bad_model", f"cannot read the tokenizer of {self._model_path}: "
                    f"{_one_line(exc)}"
                ) from None
        if self._engine_config is None:
            self._engine_config = await loop.run_in_executor(
                None, _build_engine_config, self.settings, self._model_path
            )
        if self._supervisor is None:
            self._supervisor = Supervisor(
                self._engine_config, self._engine_factory, **self._supervisor_options
            )
        try:
            await self._supervisor.ensure_loaded()
        except EngineUnavailable as exc:
            log.error("the engine did not come up: %s", exc)

    async def stop(self) -> None:
        """End the engine process (cancelling what runs)."""
        if self._supervisor is not None:
            await self._supervisor.stop()

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
        elif not 0 <= request.slot < NUM_CACHE_SLOTS:
            problem = f"cache slot must be 0..{NUM_CACHE_SLOTS - 1}, not {request.slot}"
        if problem:
            self.metrics.num_rejected += 1
            raise ServiceError(400, "bad_request", problem)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Tokens | Done | Error]:
        """Queue a generation on the one lane; bring the engine up first; yield its events.

        Raises ServiceError before any event when the request is invalid (400) or the engine
        cannot come up (503). Closing the iterator early cancels the generation and waits for
        the engine to confirm, so the next request finds it idle.
        """
        supervisor = self.supervisor
        self._check_request(request)
        self._num_waiting += 1
        try:
            await self._lane.acquire()
        finally:
            self._num_waiting -= 1
        try:
            try:
                await supervisor.ensure_loaded()
            except EngineUnavailable as exc:
                self.metrics.num_rejected += 1
                raise ServiceError(
                    503, "engine_unavailable", str(exc), retry_after_s=exc.retry_after_s
                ) from None
            request_id = f"req-{uuid.uuid4().hex[:16]}"
            self._active_request_id = request_id
            started_s = time.perf_counter()
            first_token_s: list[float] = []

            def on_end(final: Done | Error | None) -> None:
                ended_s = time.perf_counter()
                decode_s = ended_s - first_token_s[0] if first_token_s else 0.0
                self.metrics.record(final, ended_s - started_s, decode_s)

            events = supervisor.stream(
                request_id, request.prompt_ids, request.sampling, request.slot, on_end=on_end
            )
            async with aclosing(events):
                async for event in events:
                    if not first_token_s and isinstance(event, Tokens):
                        first_token_s.append(time.perf_counter())
                    yield event
        finally:
            self._active_request_id = None
            self._lane.release()

    # ---- control and status ----------------------------------------------------------------

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        """load | unload for now; the other lifecycle actions answer 400 not_applicable."""
        supervisor = self.supervisor
        if action == "load":
            try:
                await supervisor.ensure_loaded()
            except EngineUnavailable as exc:
                raise ServiceError(
                    503, "engine_unavailable", str(exc), retry_after_s=exc.retry_after_s
                ) from None
            return {"action": "load", **self.status()}
        if action == "unload":
            if self._lane.locked():
                raise ServiceError(
                    409, "busy", "a request is running; unload again when it has finished"
                )
            async with self._lane:  # no request may start while the engine goes down
                await supervisor.stop()
            return {"action": "unload", **self.status()}
        if action in LATER_ACTIONS:
            raise ServiceError(
                400, "not_applicable", f"{action} is not available in this build; "
                "only load and unload are"
            )
        raise ServiceError(
            400, "not_applicable",
            f"unknown action {action!r}; use load, unload or one of {', '.join(LATER_ACTIONS)}",
        )

    def status(self) -> dict[str, Any]:
        """A snapshot for /v1/status, /health and /metrics; never wakes anything."""
        supervisor_status = self._supervisor.status() if self._supervisor else {}
        return {
            "state": supervisor_status.get("state", "unloaded"),
            "model": self.model_id,
            "model_path": self._model_path,
            "context_tokens": self.context_tokens,
            "queue_length": self._num_waiting,
            "is_busy": self._lane.locked(),
            "active_request_id": self._active_request_id,
            "engine_pid": supervisor_status.get("pid"),
            "last_error": supervisor_status.get("last_error"),
            "retry_in_s": supervisor_status.get("retry_in_s", 0.0),
            "engine_starts": supervisor_status.get("num_starts", 0),
            "engine_crashes": supervisor_status.get("num_crashes", 0),
            "engine": supervisor_status.get("engine"),
            "counters": self.metrics.snapshot(),
        }
