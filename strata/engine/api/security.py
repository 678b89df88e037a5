"""Security middleware: Host allow-list (DNS rebinding), Origin check and CORS, API key.

These checks hold whatever the bind, so a web page the user visits cannot drive the local
server through the browser: a page from a foreign site gets neither a state change (POST
refused) nor an answer it can read (no Access-Control-Allow-Origin for it).
"""

from __future__ import annotations

import hmac
import logging

from aiohttp import web

from strata.engine.api.errors import ApiError
from strata.engine.api.keys import LOOPBACK_HOSTS, SETTINGS_KEY, ApiSettings
from strata.engine.api.origins import (
    is_origin_allowed,
    is_same_origin,
    normalize_host_name,
    split_host_header,
)

__all__ = ["add_cors_headers", "is_host_allowed", "security_middleware", "split_host_header"]

log = logging.getLogger(__name__)

# Routes a supervisor or load balancer must reach without the key.
_OPEN_PATHS = frozenset({"/health", "/v1/health"})
# Methods that only read: a foreign page may send them (the browser hides the answer from it).
_READ_METHODS = frozenset({"GET", "HEAD"})
CORS_MAX_AGE_S = 600
_CORS_METHODS = "GET, POST, OPTIONS"
# The headers SDKs send (the OpenAI and Anthropic ones add x-stainless-* and anthropic-*).
_CORS_DEFAULT_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version"


def is_host_allowed(host_header: str, settings: ApiSettings) -> bool:
    """True when the Host names a loopback address or a configured host ('*' allows any)."""
    try:
        name, _ = split_host_header(host_header)
    except ValueError:
        return False
    allowed = {normalize_host_name(h) for h in settings.allowed_hosts} | set(LOOPBACK_HOSTS)
    return "*" in allowed or normalize_host_name(name) in allowed


def _is_allowed_origin(request: web.Request, origin: str, settings: ApiSettings) -> bool:
    return (is_origin_allowed(origin, settings.allowed_origins)
            or is_same_origin(origin, request.scheme, request.headers.get("Host", "")))


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def _origin_refused(origin: str) -> ApiError:
    return ApiError(403, f"cross-site request from Origin {origin!r} refused; start Strata with "
                    f"--allowed-origins {origin} (config key allowed-origins) to let that page "
                    "call it", "origin_refused")


def _preflight(request: web.Request, origin: str, settings: ApiSettings) -> web.Response:
    """Answer a CORS preflight: 200 with the CORS headers for an allowed Origin, 200 without
    them for any other (the browser then sends nothing: the answer lacks the Origin's grant).

    200 for both, as llama-server answers: the browser decides by the headers alone. A refused
    Origin's request, if sent anyway (a simple request needs no preflight), still gets a 403.
    """
    if not _is_allowed_origin(request, origin, settings):
        log.info("CORS preflight from Origin %r refused; --allowed-origins %s lets it call",
                 origin, origin)
        return web.Response(status=200, headers={"Vary": "Origin"})
    asked = request.headers.get("Access-Control-Request-Headers", "").strip()
    return web.Response(status=200, headers={
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": _CORS_METHODS,
        # Echo what the page asks for: SDKs add headers (x-stainless-*) that change by version.
        "Access-Control-Allow-Headers": asked or _CORS_DEFAULT_HEADERS,
        "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        "Vary": "Origin, Access-Control-Request-Headers",
    })


@web.middleware
async def security_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse foreign Hosts and cross-site writes with 403, missing/wrong keys with 401;
    answer CORS preflights."""
    settings = request.app[SETTINGS_KEY]
    host = request.headers.get("Host")
    if host is None or not is_host_allowed(host, settings):
        raise ApiError(403, f"Host {host!r} is not allowed; use 127.0.0.1 or localhost, or start "
                       "Strata with --allowed-hosts NAME (config key allowed-hosts)",
                       "host_not_allowed")
    origin = request.headers.get("Origin")
    if (request.method == "OPTIONS" and origin is not None
            and "Access-Control-Request-Method" in request.headers):
        return _preflight(request, origin, settings)  # preflights carry no credentials
    if (origin is not None and request.method not in _READ_METHODS
            and not _is_allowed_origin(request, origin, settings)):
        raise _origin_refused(origin)
    if settings.api_key and request.path not in _OPEN_PATHS:
        key = _presented_key(request)
        if key is None:
            raise ApiError(401, "missing API key; send 'Authorization: Bearer KEY' or "
                           "'x-api-key: KEY'", "missing_api_key")
        if not hmac.compare_digest(key.encode("utf-8", "surrogateescape"),
                                   settings.api_key.encode("utf-8", "surrogateescape")):
            raise ApiError(401, "wrong API key; use the key the server was started with",
                           "invalid_api_key")
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: let an allowed Origin's page read the answer (streams and errors
    too, since this runs just before any response's headers are sent)."""
    origin = request.headers.get("Origin")
    if origin is None or "Access-Control-Allow-Origin" in response.headers:
        return
    if _is_allowed_origin(request, origin, request.app[SETTINGS_KEY]):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers.add("Vary", "Origin")
