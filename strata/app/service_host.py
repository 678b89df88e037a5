"""Runs the Service (and its HTTP endpoint) on a worker thread with its own asyncio loop. Qt-free.

The tray talks to it only through `ServiceHost`: start, call an action, set rules, stop. What
happens on the loop comes back through a `HostListener` (called on the worker thread); the Qt
bridge turns those calls into signals.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from strata.app.menu_model import DONE_VERB
from strata.engine.service.rules import Rule, RuleEvent
from strata.engine.service.rules_engine import RulesEngine
from strata.engine.service.service import LevelEvent
from strata.engine.service.telemetry import GpuTelemetry, read_ram
from strata.errors import StrataError, user_message
from strata.host.root import Host, own_pids
from strata.paths import model_cache_dir

log = logging.getLogger(__name__)


class RunningServer(Protocol):
    """A started Service with its HTTP endpoint; stop() ends both."""

    service: Any  # ServiceFacade
    endpoint_url: str

    async def stop(self) -> None: ...


ServerFactory = Callable[[Any], Awaitable[RunningServer]]


class HostListener(Protocol):
    """Receives what happens on the service loop; every method runs on the worker thread."""

    def on_status(self, status: dict[str, Any]) -> None: ...
    def on_action(self, action: str, result: dict[str, Any] | None, error: str | None) -> None: ...
    def on_rule_event(self, event: RuleEvent) -> None: ...
    def on_log(self, line: str) -> None: ...


class ServiceHost(Protocol):
    """What the tray needs from the thing that runs the service."""

    def start(self, settings: Any, listener: HostListener) -> None: ...
    def call(self, action: str, **kwargs: Any) -> concurrent.futures.Future: ...
    def set_rules(
        self, rules: list[Rule] | None = None, is_enabled: bool | None = None
    ) -> None: ...
    def stop(self, timeout_s: float = 30.0) -> None: ...
    def rescan(self) -> None: ...
    @property
    def models_dir(self) -> Path: ...


def describe_error(exc: BaseException) -> str:
    """One line for the user: the ServiceError/StrataError message, else type and text."""
    message = getattr(exc, "message", None) or user_message(exc)
    return str(message) if message else f"{type(exc).__name__}: {exc}"


def _memory_kind(readings: dict[str, Any]) -> str:
    """Before the service says (starting, failed): VRAM where the telemetry sees a GPU."""
    return "VRAM" if readings.get("gpu") is not None else "RAM"


@dataclass
class HostOptions:
    # The service's state comes by event (service.state_listeners); only the GPU and RAM
    # readings of the chart, which have no events, are read on this tick.
    telemetry_interval_s: float = 1.0
    rules_interval_s: float = 0.5  # VRAM triggers; process triggers react at once


class ThreadServiceHost:
    """ServiceHost over a daemon thread running asyncio; the server is built by server_factory."""

    def __init__(
        self,
        server_factory: ServerFactory,
        rules: list[Rule] | None = None,
        rules_enabled: bool = True,
        options: HostOptions | None = None,
        telemetry: GpuTelemetry | None = None,
    ):
        self._factory = server_factory
        self._options = options or HostOptions()
        self._telemetry = telemetry or GpuTelemetry()
        self._rules = list(rules or [])
        self._rules_enabled = rules_enabled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._server: RunningServer | None = None
        self._rules_engine: RulesEngine | None = None
        self._listener: HostListener | None = None
        self._start_error: str | None = None
        self._settings: Any = None
        self._rules_task: asyncio.Task | None = None
        self._is_publish_due = False  # a state event's publish is scheduled

    # ---- Qt thread side -----------------------------------------------------------------

    def start(self, settings: Any, listener: HostListener) -> None:
        """Start the worker thread; returns once its loop runs (the server comes up after)."""
        self._listener = listener
        self._thread = threading.Thread(
            target=self._thread_main, args=(settings,), name="strata-service", daemon=True
        )
        self._thread.start()
        self._ready.wait()

    def call(self, action: str, **kwargs: Any) -> concurrent.futures.Future:
        """Run service.control(action) on the loop; the outcome goes to listener.on_action."""
        if self._loop is None:
            raise RuntimeError("ServiceHost.call before start()")
        return asyncio.run_coroutine_threadsafe(self._control(action, kwargs), self._loop)

    def set_rules(self, rules: list[Rule] | None = None, is_enabled: bool | None = None) -> None:
        """Replace the rules and/or switch them on or off, live."""
        if rules is not None:
            self._rules = list(rules)
        if is_enabled is not None:
            self._rules_enabled = is_enabled
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._apply_rules)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server cleanly (engine included) and join the thread."""
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass  # the loop already finished
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("service thread did not stop within %.0f s", timeout_s)
                return
        # Nothing calls the listener now. Dropping it breaks the bridge <-> host cycle, so a
        # stopped bridge (a QObject) is freed when its owner lets go, not by the cyclic GC at
        # a later moment inside unrelated code: Qt objects freed that way are a known source
        # of crashes (a CI test worker segfaulted in such a collection, stop 48).
        self._listener = None

    @property
    def endpoint_url(self) -> str | None:
        return self._server.endpoint_url if self._server is not None else None

    @property
    def models_dir(self) -> Path:
        """Where a pull puts models: the pool's library (POOL_CONTRACT.md); a single-model
        Service, or no server, has none: the model cache."""
        service = self._server.service if self._server is not None else None
        return getattr(service, "models_dir", None) or model_cache_dir()

    def rescan(self) -> None:
        """Have the pool re-read its library (after a pull); its rows come as a status."""
        if self._loop is None:
            raise RuntimeError("ServiceHost.rescan before start()")
        asyncio.run_coroutine_threadsafe(self._rescan(), self._loop)

    # ---- worker thread side -------------------------------------------------------------

    def _thread_main(self, settings: Any) -> None:
        try:
            asyncio.run(self._main(settings))
        except Exception:  # never silently: the tray shows the error state from on_status
            log.exception("service thread crashed")
        finally:
            self._ready.set()

    async def _main(self, settings: Any) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        self._ready.set()
        readings = await asyncio.to_thread(self._readings)
        self._publish({"state": "starting", **readings, "memory_kind": _memory_kind(readings)})
        self._settings = settings
        await self._start_server()
        telemetry_task = asyncio.create_task(self._telemetry_loop())
        await self._stop_event.wait()
        telemetry_task.cancel()
        if self._server is not None:
            if self._rules_task is not None:
                self._rules_task.cancel()
            try:
                await self._server.stop()
            except Exception:
                log.exception("server stop failed")

    async def _start_server(self) -> bool:
        """Build the server; on failure stay up in the "failed" state (Load tries again)."""
        try:
            self._server = await self._factory(self._settings)
        except Exception as exc:
            self._start_error = f"could not start the server: {describe_error(exc)}"
            if user_message(exc) or hasattr(exc, "message"):
                log.error("%s", self._start_error)  # expected failure: one line, no traceback
            else:
                log.exception("server start failed")
            return False
        self._start_error = None
        self._emit_log(f"serving at {self._server.endpoint_url}")
        self._server.service.level_listeners.append(self._on_level_event)
        self._server.service.state_listeners.append(self._on_state_event)
        self._on_state_event()  # what it is now
        self._rules_engine = RulesEngine(
            self._server.service,
            self._rules,
            on_event=self._on_rule_event,
            vram_reader=self._telemetry.read,
            own_pids=own_pids,
            is_enabled=self._rules_enabled,
        )
        self._rules_task = asyncio.create_task(
            self._rules_engine.run(self._options.rules_interval_s)
        )
        return True

    def _apply_rules(self) -> None:
        if self._rules_engine is not None:
            self._rules_engine.set_rules(self._rules)
            self._rules_engine.set_enabled(self._rules_enabled)

    def _readings(self) -> dict[str, Any]:
        # NVML and psutil block for a few ms: the caller runs this off the loop
        return {
            "gpu": self._telemetry.read(),
            "ram": read_ram(own_pids()),
            "gpu_unavailable_reason": self._telemetry.unavailable_reason,
        }

    async def _snapshot(self) -> dict[str, Any]:
        if self._server is None:
            status: dict[str, Any] = {"state": "failed", "last_error": self._start_error}
        else:
            status = dict(self._server.service.status())  # on the loop: the service's own thread
            status["endpoint"] = self._server.endpoint_url
        status["rules_enabled"] = self._rules_enabled
        readings = await asyncio.to_thread(self._readings)
        status.update(readings)
        status.setdefault("memory_kind", _memory_kind(readings))  # the service's own wins
        return status

    def _on_state_event(self) -> None:
        """The service's state may have changed: publish once, soon, on the loop (from any
        thread); several changes in one step of the loop make one publish."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._schedule_publish)

    def _schedule_publish(self) -> None:
        if not self._is_publish_due:
            self._is_publish_due = True
            assert self._loop is not None  # _on_state_event scheduled this call on that loop
            self._loop.create_task(self._publish_state())

    async def _publish_state(self) -> None:
        self._is_publish_due = False
        try:
            self._publish(await self._snapshot())
        except Exception:
            log.exception("status publish failed")

    async def _telemetry_loop(self) -> None:
        """GPU and RAM readings for the chart (NVML has no events), with the status they go
        beside."""
        while True:
            await asyncio.sleep(self._options.telemetry_interval_s)
            await self._publish_state()

    async def _control(self, action: str, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if self._server is None and action == "load":  # the server never came up: retry it
            if not await self._start_server():
                self._call_listener("on_action", action, None, self._start_error)
                return None
            self._call_listener("on_action", action, {}, None)
            self._publish(await self._snapshot())
            return {}
        if self._server is None:
            self._call_listener(
                "on_action", action, None, self._start_error or "the server is not running"
            )
            return None
        try:
            result = await self._server.service.control(action, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure is reported to the listener, not raised into Qt
            self._call_listener("on_action", action, None, describe_error(exc))
            return None
        self._call_listener("on_action", action, result or {}, None)
        self._publish(await self._snapshot())
        return result

    async def _rescan(self) -> None:
        rescan = getattr(self._server.service, "rescan", None) if self._server else None
        if rescan is None:  # a single-model Service lists no library
            return
        try:
            await rescan()
        except Exception as exc:  # noqa: BLE001 - reported in the log, never raised into Qt
            self._emit_log(f"rescan of the models failed: {describe_error(exc)}")
            return
        self._publish(await self._snapshot())

    def _on_level_event(self, event: LevelEvent) -> None:
        """Log what the service did by itself (an idle timer); what the tray, a rule or an
        API client asked for is logged where it was asked."""
        if event.cause is None:
            return
        model = event.model  # None from a single-model Service
        what = f" {model}" if model else ""
        if event.is_ok:
            self._emit_log(f"{event.cause}: "
                           f"{DONE_VERB.get(event.action, event.action).lower()}{what}")
        else:
            self._emit_log(f"{event.cause}: {event.action.replace('_', ' ')}{what} failed")

    def _on_rule_event(self, event: RuleEvent) -> None:
        self._call_listener("on_rule_event", event)

    def _emit_log(self, line: str) -> None:
        self._call_listener("on_log", line)

    def _publish(self, status: dict[str, Any]) -> None:
        self._call_listener("on_status", status)

    def _call_listener(self, method: str, *args: Any) -> None:
        if self._listener is not None:
            try:
                getattr(self._listener, method)(*args)
            except Exception:
                log.exception("listener %s failed", method)


def _failing_factory(message: str) -> ServerFactory:
    async def factory(settings: Any) -> RunningServer:
        raise RuntimeError(message)  # shown as the tray's error state; Settings can fix it

    return factory


def tray_service_host(config_file: str | None, overrides: dict[str, Any], *,
                      options: HostOptions | None = None,
                      **host_options: Any) -> tuple[ThreadServiceHost, Any]:
    """The tray's service host and settings, built by the same Host (one read of the config
    file) as `strata serve`; a config that cannot be read shows as the error state, with
    settings None. host_options go to Host (tests pass make_service)."""
    try:
        root = Host.from_config(config_file, overrides, port_advice="--port or in Settings",
                                **host_options)
    except StrataError as exc:  # the settings' and config file's errors: one line
        message = user_message(exc) or str(exc)
        return ThreadServiceHost(_failing_factory(message), options=options), None
    try:
        rules = root.rules
    except StrataError as exc:
        log.error("rules not loaded: %s", user_message(exc) or exc)
        rules = []
    host = ThreadServiceHost(root.start_server, rules=rules, rules_enabled=root.rules_enabled,
                             options=options)
    return host, root.settings
