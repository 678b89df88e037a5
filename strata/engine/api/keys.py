"""Typed application state shared by the API modules (aiohttp `web.AppKey`)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from strata.engine.api.responses_store import ResponseStore
from strata.engine.service.facade import ServiceFacade

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Long prompts are big JSON: a 128k-token context is about 1 MiB of text, tools included a few.
MAX_REQUEST_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ApiSettings:
    """Security settings of one app: optional API key, extra Host names and Origins allowed."""

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ()  # besides LOOPBACK_HOSTS, which are always allowed
    allowed_origins: tuple[str, ...] = ()
    metrics_endpoint: bool = True  # off: GET /metrics answers 501
    slots_endpoint: bool = True  # off: GET /slots answers 501
    embedding_pooling: str = "model"  # model (its own declaration) or protocol.POOLINGS


@dataclass
class Lifecycle:
    """Whether the app is shutting down (set by its on_shutdown, before aiohttp cancels the
    handlers still running): a cancelled handler was then stopped by the server, not by a
    client that went away."""

    stopping: bool = False


SERVICE_KEY = web.AppKey("strata_service", ServiceFacade)
LIFECYCLE_KEY = web.AppKey("strata_lifecycle", Lifecycle)
SETTINGS_KEY = web.AppKey("strata_api_settings", ApiSettings)
RESPONSES_KEY = web.AppKey("strata_responses", ResponseStore)
