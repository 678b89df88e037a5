"""The aiohttp application factory for Strata's HTTP API."""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from strata.engine.api.cpu_pool import cpu_pool_context
from strata.engine.api.errors import error_middleware
from strata.engine.api.keys import (
    LIFECYCLE_KEY,
    MAX_REQUEST_BYTES,
    RESPONSES_KEY,
    SERVICE_KEY,
    SETTINGS_KEY,
    ApiSettings,
    Lifecycle,
)
from strata.engine.api.model_routing import model_middleware
from strata.engine.api.origins import DEFAULT_ALLOWED_ORIGINS
from strata.engine.api.responses_store import ResponseStore
from strata.engine.api.routes import setup_routes
from strata.engine.api.security import add_cors_headers, security_middleware
from strata.engine.service.facade import ServiceFacade


def create_app(service: ServiceFacade, *, api_key: str | None = None,
               allowed_hosts: Iterable[str] = (),
               allowed_origins: Iterable[str] = (), metrics_endpoint: bool = True,
               slots_endpoint: bool = True,
               embedding_pooling: str = "model") -> web.Application:
    """Build the API app over a service.

    allowed_hosts: Host names accepted besides the loopback names ('*' accepts any).
    allowed_origins: browser Origins allowed to call the API (CORS) besides our own and
    DEFAULT_ALLOWED_ORIGINS: exact origins or patterns (http://host:*, app://*, *).
    metrics_endpoint, slots_endpoint: off, GET /metrics or /slots answers 501.
    embedding_pooling: the embeddings' pooling (model: what the model declares).
    The caller owns the service's lifetime and the bind address.
    """
    # The model is resolved after the key and origin checks: an unknown name is no clue for a
    # caller without the key.
    app = web.Application(middlewares=[error_middleware, security_middleware, model_middleware],
                          client_max_size=MAX_REQUEST_BYTES)
    app[SERVICE_KEY] = service
    app[SETTINGS_KEY] = ApiSettings(api_key=api_key or None,
                                    allowed_hosts=tuple(allowed_hosts),
                                    allowed_origins=(*DEFAULT_ALLOWED_ORIGINS,
                                                     *(o.rstrip("/") for o in allowed_origins)),
                                    metrics_endpoint=metrics_endpoint,
                                    slots_endpoint=slots_endpoint,
                                    embedding_pooling=embedding_pooling)
    app.on_response_prepare.append(add_cors_headers)
    app[LIFECYCLE_KEY] = Lifecycle()
    app.on_shutdown.append(_mark_stopping)
    app.cleanup_ctx.append(cpu_pool_context)
    app[RESPONSES_KEY] = ResponseStore()
    setup_routes(app)
    return app


async def _mark_stopping(app: web.Application) -> None:
    """on_shutdown: runs before aiohttp cancels the handlers still running."""
    app[LIFECYCLE_KEY].stopping = True
