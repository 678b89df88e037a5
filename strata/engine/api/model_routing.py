"""Which model answers a request: its `model` field (or `?model=`), through one resolver.

The middleware resolves the model of every route that generates, embeds, tokenizes or changes
a level before the handler runs; handlers read it with service_of(request). An absent model is
the default (the one the server was started with); an unknown name is a 404 in the route's
API shape (errors.py), unless --model-fallback default. A server over one plain Service (the
API tests' fake) has nothing to choose from: every request gets that service.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata.engine.api.errors import ApiError
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.validation import optional_json_object
from strata.engine.service.facade import ServiceFacade
from strata.engine.service.model_pool import ModelNotFound, ModelPool

MODEL_SERVICE_KEY = web.RequestKey("strata_model_service", ServiceFacade)
# Routes whose request may name a model (a JSON body's "model", or ?model= on a GET).
MODEL_ROUTES = frozenset({
    "/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
    "/v1/responses", "/responses", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/chat/completions/input_tokens", "/chat/completions/input_tokens",
    "/v1/responses/input_tokens", "/responses/input_tokens",
    "/v1/embeddings", "/embeddings", "/embedding",
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/show",
    "/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
    "/load", "/unload", "/sleep", "/wake", "/cache/release", "/cache/refill", "/cache/shrink",
    "/session/offload",
})


def model_pool(app: web.Application) -> ModelPool | None:
    """The app's ModelPool; None when it serves one plain Service."""
    service = app[SERVICE_KEY]
    return service if isinstance(service, ModelPool) else None


async def requested_model(request: web.Request) -> str | None:
    """The model a request names: its JSON body's "model" (Ollama's /api/show also "name"),
    else ?model=; None when it names none. The body is read through the one body parser
    (validation.py), so a body that is no JSON object is that parser's 400 here already."""
    name: Any = None
    if request.method == "POST" and request.can_read_body:
        body = await optional_json_object(request)
        if body is not None:
            name = body.get("model")
            if name is None and request.path == "/api/show":
                name = body.get("name")
    if name is None:
        name = request.query.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, f"'model' must be a model's name (a string), got {name!r:.40}",
                       param="model")
    return name or None


async def resolve_service(request: web.Request) -> ServiceFacade:
    """THE resolver: the service of the model the request names (see the module's doc)."""
    pool = model_pool(request.app)
    if pool is None:
        return request.app[SERVICE_KEY]
    name = await requested_model(request)
    try:
        return await pool.resolve(name)
    except ModelNotFound as exc:
        raise ApiError(404, exc.message, "model_not_found", param="model") from None


def _names_a_model(path: str) -> bool:
    return path in MODEL_ROUTES or path.startswith("/slots/")


@web.middleware
async def model_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Resolve the request's model before the handler (after the key and origin checks)."""
    if _names_a_model(request.path) and request.method in ("GET", "POST"):
        request[MODEL_SERVICE_KEY] = await resolve_service(request)
    return await handler(request)


def apply_ttl(service: Any, body: dict[str, Any]) -> None:
    """LM Studio's `ttl` on an OpenAI request: the requested model unloads after that many
    idle seconds from now on (its own unload timer, as Ollama's keep_alive sets it)."""
    ttl = body.get("ttl")
    if ttl is None:
        return
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < 1e9:
        raise ApiError(400, "'ttl' must be the seconds idle before the model unloads, a "
                       f"number > 0, got {ttl!r:.40}", param="ttl")
    service.set_unload_idle(float(ttl))


def service_of(request: web.Request) -> Any:
    """The service that answers this request: its model's, else the app's (default) one."""
    found = request.get(MODEL_SERVICE_KEY)
    return found if found is not None else request.app[SERVICE_KEY]
