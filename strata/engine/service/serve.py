"""`strata serve`: settings -> Service -> the HTTP API, until SIGINT/SIGTERM.

The config file's [[rules]] run headless here too, through the same RulesEngine as the tray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from strata.engine.service.facade import ServiceError
from strata.engine.service.rules import rules_engine_from_config
from strata.engine.service.service import Service
from strata.engine.service.settings import (
    ServeSettings,
    SettingsError,
    default_config_file,
    load_settings,
    overrides_from_args,
)
from strata.engine.service.telemetry import GpuTelemetry
from strata.errors import StrataError
from strata.logs import setup_logging

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
RULES_INTERVAL_S = 2.0


class ServeError(StrataError):
    """The server could not start; the message says why and what to do."""


def serve_from_args(args: argparse.Namespace) -> int:
    """Entry of `strata serve`: read the settings, run the server until interrupted."""
    config_file = getattr(args, "config", None)
    settings = load_settings(config_file, overrides_from_args(args))
    config = read_config_tables(config_file)
    setup_logging("serve", "strata: %(message)s")  # a rotating file when run without a console
    return asyncio.run(serve(settings, config=config))


def read_config_tables(config_file: str | Path | None) -> dict[str, Any]:
    """The whole config file as a dict (for its [[rules]] and [tray] tables); {} without one.

    load_settings has already checked that the file exists and parses.
    """
    path = Path(config_file).expanduser() if config_file is not None else default_config_file()
    if path is None:
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config file {path}: {exc}") from None


def own_pids() -> set[int]:
    """This process and its children (engine and standby): the VRAM that is Strata's own."""
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids.update(child.pid for child in me.children(recursive=True))
    return pids


async def serve(
    settings: ServeSettings,
    *,
    service: Any = None,
    stop_event: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    config: Mapping[str, Any] | None = None,
    rules_interval_s: float = RULES_INTERVAL_S,
) -> int:
    """Start the service and its API on settings.host:port; stop on SIGINT/SIGTERM or stop_event.

    `service` replaces Service(settings) (tests run a fake engine through it); on_listening
    gets the endpoint URL once the port is bound; `config` is the parsed config file, whose
    [[rules]] then run every rules_interval_s.
    """
    from strata.engine.api.app import create_app  # the api layer depends on us, not the reverse

    service = service if service is not None else Service(settings)
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop_event.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            pass
    try:
        await service.start()
    except ServiceError as exc:
        raise ServeError(exc.message) from None
    # Binding all interfaces is the user asking for LAN clients, whose Host headers vary.
    allowed_hosts = ("*",) if settings.host in WILDCARD_HOSTS else (settings.host,)
    # handler_cancellation: a client that goes away cancels its handler at once, so its
    # generation stops even while it waits in the queue or in a long prefill.
    runner = web.AppRunner(
        create_app(service, api_key=settings.api_key, allowed_hosts=allowed_hosts),
        handler_cancellation=True,
    )
    await runner.setup()
    rules_task = None
    try:
        try:
            await web.TCPSite(runner, settings.host, settings.port).start()
        except OSError as exc:
            raise ServeError(f"cannot listen on {settings.host}:{settings.port} "
                             f"({exc.strerror}); pick another port with --port") from None
        url = f"http://{_display_host(settings.host)}:{_bound_port(runner, settings.port)}/v1"
        status = service.status()
        log.info("serving %s at %s (engine %s)", service.model_id, url, status.get("state"))
        if on_listening is not None:
            on_listening(url)
        rules_task = _start_rules(service, config or {}, rules_interval_s)
        await stop_event.wait()
        log.info("stopping")
    finally:
        if rules_task is not None:
            rules_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rules_task
        await runner.cleanup()
        await service.stop()
    return 0


def _start_rules(service: Any, config: Mapping[str, Any], interval_s: float) -> asyncio.Task | None:
    """Run the config's rules on this loop, as the tray does; None when there are none."""
    if not config.get("rules"):
        return None
    telemetry = GpuTelemetry()
    rules = rules_engine_from_config(
        service, config, vram_reader=telemetry.read, own_pids=own_pids,
        on_event=lambda event: log.info("rule %s", event.sentence),
    )
    log.info("running %d rule(s) headless%s", len(rules.rules),
             "" if rules.is_enabled else " (turned off in [tray])")
    return asyncio.create_task(rules.run(interval_s), name="strata-rules")


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else (f"[{host}]" if ":" in host else host)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback
