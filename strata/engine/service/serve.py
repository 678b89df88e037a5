"""`strata serve`: settings -> Service -> the HTTP API, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web

from strata.engine.service.facade import ServiceError
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings, load_settings, overrides_from_args
from strata.errors import StrataError

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class ServeError(StrataError):
    """The server could not start; the message says why and what to do."""


def serve_from_args(args: argparse.Namespace) -> int:
    """Entry of `strata serve`: read the settings, run the server until interrupted."""
    settings = load_settings(getattr(args, "config", None), overrides_from_args(args))
    logging.basicConfig(level=logging.INFO, format="strata: %(message)s", stream=sys.stderr)
    return asyncio.run(serve(settings))


async def serve(
    settings: ServeSettings,
    *,
    service: Any = None,
    stop_event: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
) -> int:
    """Start the service and its API on settings.host:port; stop on SIGINT/SIGTERM or stop_event.

    `service` replaces Service(settings) (tests run a fake engine through it); on_listening
    gets the endpoint URL once the port is bound.
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
        await stop_event.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        await service.stop()
    return 0


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in WILDCARD_HOSTS else (f"[{host}]" if ":" in host else host)


def _bound_port(runner: web.AppRunner, fallback: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return fallback
