"""Host: reads the configuration once and builds the Service, its rules and the HTTP runner.

`strata serve` (host/serve.py) and the tray (app/main.py, app/service_host.py) are two front
ends of this one root (STYLE §16), so the two cannot drift: the same settings reader, the
same runner (Host allow-list for the bind, origins, key, handler cancellation), the same rules.
The service never imports the API layer: this root hands the service to the API.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web

from strata.engine.api.listen import Listening, bind_sockets, close_sockets, start_listening
from strata.engine.service.config_file import read_config
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.rules import Rule, rules_from_config
from strata.engine.service.rules_engine import RulesEngine
from strata.engine.service.settings import ServeSettings, config_file_path, settings_from_config

log = logging.getLogger(__name__)
TRAY_TABLE = "tray"  # [tray] rules_enabled: whether the [[rules]] run, in the tray and serve
MODELS_TABLE = "models"  # [models.NAME] path, aliases: models besides --models-dir's


def own_pids() -> set[int]:
    """This process and its children (engine and standby): the VRAM that is Strata's own."""
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids.update(child.pid for child in me.children(recursive=True))
    return pids


@dataclass
class HostServer:
    """A started Service with its HTTP endpoint (the tray's RunningServer); stop() ends both."""

    service: Any
    runner: web.AppRunner
    endpoint_url: str

    async def stop(self) -> None:
        """Stop accepting requests, then end the engine process."""
        await self.runner.cleanup()
        await self.service.stop()


@dataclass
class Host:
    """The parts of one host process, built from one read of the configuration.

    settings: the server settings; config: the whole config file as parsed (its [[rules]] and
    [tray] tables); make_service: builds the service from settings (tests pass a fake engine);
    port_advice: where the user changes the port, in a bind error.
    """

    settings: ServeSettings
    config: Mapping[str, Any] = field(default_factory=dict)
    make_service: Callable[[ServeSettings], Any] | None = None  # None: a ModelPool
    port_advice: str = "--port"

    @classmethod
    def from_config(cls, config_file: str | Path | None, overrides: Mapping[str, Any],
                    **options: Any) -> Host:
        """Read the config file (None: the standard one, if present) once: settings from its
        keys, the environment and overrides (flags); rules from its tables.
        Raises SettingsError with a one-line message naming the key."""
        path = config_file_path(config_file)
        data = read_config(path, must_exist=True) if path is not None else {}
        settings = settings_from_config(data, overrides, where=f"config file {path}")
        return cls(settings, data, **options)

    @property
    def rules(self) -> list[Rule]:
        """The config file's [[rules]] (RuleConfigError when one is invalid)."""
        return rules_from_config(self.config.get("rules", []))

    @property
    def rules_enabled(self) -> bool:
        return bool((self.config.get(TRAY_TABLE) or {}).get("rules_enabled", True))

    def build_service(self) -> Any:
        """The ModelPool over the settings and the config's [models] tables (make_service
        replaces it: tests build one Service over a fake engine)."""
        if self.make_service is not None:
            return self.make_service(self.settings)
        return ModelPool(self.settings, self.config.get(MODELS_TABLE))

    def bind(self) -> list[socket.socket]:
        """Bind host:port before the model loads: a port in use fails at once, not after."""
        return bind_sockets(self.settings.host, self.settings.port,
                            port_advice=self.port_advice)

    async def listen(self, service: Any, sockets: list[socket.socket]) -> Listening:
        """Serve the API over `service` on sockets from bind(): the one HTTP runner of both
        front ends."""
        return await start_listening(service, self.settings, port_advice=self.port_advice,
                                     sockets=sockets)

    def rules_engine(self, service: Any, *, rules: list[Rule] | None = None,
                     is_enabled: bool | None = None, **options: Any) -> RulesEngine:
        """The rules over `service`: the config's, unless rules/is_enabled say otherwise
        (the tray edits them live); options: on_event, vram_reader, own_pids."""
        options.setdefault("own_pids", own_pids)
        return RulesEngine(service, self.rules if rules is None else rules,
                           is_enabled=self.rules_enabled if is_enabled is None else is_enabled,
                           **options)

    async def start_server(self, settings: ServeSettings | None = None, *,
                           service: Any = None) -> HostServer:
        """Bind, start the service (or `service`), serve the API: the tray's server factory.

        settings, when given, must be this Host's (the tray passes back what it was given).
        An engine that fails to load leaves the service up in the "failed" state.
        Raises StrataError with a one-line message when the address cannot be bound.
        """
        if settings is not None and settings is not self.settings:
            raise ValueError("Host.start_server: settings differ from the Host's own")
        sockets = self.bind()
        service = service if service is not None else self.build_service()
        try:
            await service.start()
            listening = await self.listen(service, sockets)
        except BaseException:
            close_sockets(sockets)
            await service.stop()
            raise
        log.info("listening at %s", listening.endpoint_url)
        return HostServer(service, listening.runner, listening.endpoint_url)
