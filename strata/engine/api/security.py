"""Security middleware: Host allow-list (DNS rebinding), Origin check on POST, API key.

Binding to an address is the caller's business; these checks hold whatever the bind, so a web
page the user visits cannot drive the local server through the browser.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from yarl import URL

from strata.engine.api.errors import ApiError
from strata.engine.api.keys import LOOPBACK_HOSTS, SETTINGS_KEY, ApiSettings

# Routes a supervisor or load balancer must reach without the key.
_OPEN_PATHS = frozenset({"/health", "/v1/health"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def split_host_header(value: str) -> tuple[str, int | None]:
    """'[::1]:8080' -> ('::1', 8080); 'Localhost.' -> ('localhost', None). Raises ValueError."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"malformed Host {value!r}")
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError(f"malformed Host {value!r}")
        port_text = rest[1:]
    elif value.count(":") == 1:
        name, port_text = value.split(":")
    else:
        name, port_text = value, ""
    if not name:
        raise ValueError("empty Host")
    port = int(port_text) if port_text else None  # int() raises ValueError on junk
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return name.lower().rstrip("."), port


def is_host_allowed(host_header: str, settings: ApiSettings) -> bool:
    """True when the Host names a loopback address or a configured host ('*' allows any)."""
    try:
        name, _ = split_host_header(host_header)
    except ValueError:
        return False
    allowed = {h.lower().strip("[]") for h in settings.allowed_hosts} | set(LOOPBACK_HOSTS)
    return "*" in allowed or name in allowed


def is_same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """True when Origin is exactly this server's scheme://host:port (default ports folded)."""
    try:
        url = URL(origin)
        name, port = split_host_header(host_header)
    except ValueError:
        return False
    if not url.scheme or not url.host or url.path not in ("", "/"):
        return False
    own_port = port if port is not None else _DEFAULT_PORTS.get(scheme)
    return (url.scheme.lower() == scheme and url.host.lower().rstrip(".") == name.strip("[]")
            and url.port == own_port)


def _presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


@web.middleware
async def security_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Refuse foreign Hosts and cross-site POSTs with 403, missing/wrong keys with 401."""
    settings = request.app[SETTINGS_KEY]
    host = request.headers.get("Host")
    if host is None or not is_host_allowed(host, settings):
        raise ApiError(403, f"Host {host!r} is not allowed; use 127.0.0.1 or localhost, or add "
                       "the name to the server's allowed hosts", "host_not_allowed")
    origin = request.headers.get("Origin")
    if (request.method == "POST" and origin is not None
            and origin not in settings.allowed_origins
            and not is_same_origin(origin, request.scheme, host)):
        raise ApiError(403, f"cross-site request from Origin {origin!r} refused; add it to the "
                       "server's allowed origins to let that page call Strata", "origin_refused")
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
