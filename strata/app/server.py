"""Start the real Service plus its aiohttp endpoint on the running loop, for the tray. Qt-free.

The same parts as `strata serve`: Service(settings) and engine/api's create_app, bound to
settings.host:settings.port before the model loads (port 0 picks a free one; endpoint_url
reports the real one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from strata.engine.service.listen import bind_sockets, bound_port, close_sockets

log = logging.getLogger(__name__)


@dataclass
class TrayServer:
    """A RunningServer: the Service, the aiohttp runner and the URL chat apps use."""

    service: Any
    runner: web.AppRunner
    endpoint_url: str

    async def stop(self) -> None:
        """Stop accepting requests, then end the engine process."""
        await self.runner.cleanup()
        await self.service.stop()


async def start_tray_server(settings: Any) -> TrayServer:
    """Start Service(settings) and its HTTP API; raises with a one-line message on failure."""
    from strata.engine.api.app import create_app
    from strata.engine.service.service import Service

    sockets = bind_sockets(settings.host, settings.port)  # a busy port fails before any load
    service = Service(settings)
    try:
        await service.start()  # an engine that fails to load leaves the service up, "failed"
        runner = web.AppRunner(create_app(service, api_key=settings.api_key),
                               handle_signals=False)
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
    except BaseException:
        close_sockets(sockets)
        await service.stop()
        raise
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    url = f"http://{host}:{bound_port(sockets, settings.port)}/v1"
    log.info("tray server listening at %s", url)
    return TrayServer(service, runner, url)
