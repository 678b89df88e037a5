"""Start the real Service plus its aiohttp endpoint on the running loop, for the tray. Qt-free.

The same parts as `strata serve`: Service(settings), and engine/api's start_listening, which
both front ends share (Host allow-list for the bind, origins, key, handler cancellation), bound
to settings.host:settings.port (port 0 picks a free one; endpoint_url reports the real one).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web

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


async def start_tray_server(settings: Any, *, service: Any = None) -> TrayServer:
    """Start Service(settings) (or `service`, for tests) and its HTTP API.

    Raises StrataError with a one-line message when the address cannot be bound.
    """
    from strata.engine.api.listen import ListenError, start_listening
    from strata.engine.service.service import Service

    service = service if service is not None else Service(settings)
    await service.start()  # an engine that fails to load leaves the service up, "failed"
    try:
        listening = await start_listening(service, settings,
                                          port_advice="--port or in Settings")
    except ListenError:
        await service.stop()
        raise
    log.info("tray server listening at %s", listening.endpoint_url)
    return TrayServer(service, listening.runner, listening.endpoint_url)
