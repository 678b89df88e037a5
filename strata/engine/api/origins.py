"""Which browser Origins may call the API, and which Host names it answers to.

Written by hand rather than with aiohttp-cors: that library configures CORS per route and has no
port wildcard (`http://localhost:*`), which local chat UIs on any dev-server port need; the rules
here are a few lines and are the same for every route.
"""

from __future__ import annotations

import ipaddress
import re

from yarl import URL

# Origins a local server lets call it by default, as Ollama does: pages served from this
# machine on any port, desktop-app shells (Electron app://, Tauri, VS Code webviews) and
# Electron's file:// pages. Not "null": a sandboxed iframe of any web site sends that too.
DEFAULT_ALLOWED_ORIGINS = (
    "http://localhost:*", "https://localhost:*", "http://127.0.0.1:*", "https://127.0.0.1:*",
    "http://[::1]:*", "https://[::1]:*", "app://*", "file://", "tauri://*",
    "vscode-webview://*",
)
_DEFAULT_PORTS = {"http": 80, "https": 443}
# A DNS name or IPv4 address as a Host header carries it (RFC 3986 reg-name, the characters
# names use): nothing else, so 'localhost%00evil' cannot pass as localhost.
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]{1,253}")


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
    if value.startswith("["):
        ipaddress.IPv6Address(name)  # ValueError on junk; a zone id ('%eth0') is refused
        if "%" in name:
            raise ValueError(f"Host {value!r} has an IPv6 zone id")
    elif not _HOST_NAME.fullmatch(name):
        raise ValueError(f"malformed Host {value!r}")
    if port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        raise ValueError(f"malformed port in Host {value!r}")
    port = int(port_text) if port_text else None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return name.lower().rstrip("."), port


def normalize_host_name(name: str) -> str:
    """How a configured or reported host name is compared: lower case, no brackets, no
    trailing dot, no IPv6 zone ('fe80::1%eth0' -> 'fe80::1')."""
    return name.strip().strip("[]").split("%", 1)[0].lower().rstrip(".")


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


def origin_matches(origin: str, pattern: str) -> bool:
    """Does a browser Origin match an allowed-origins entry?

    Entries: '*' (any), 'scheme://*' (any origin of that scheme), 'scheme://host:*' (that host
    on any port, or none), else one exact origin. Scheme and host compare case-insensitively.
    """
    origin, pattern = origin.strip().rstrip("/").lower(), pattern.strip().rstrip("/").lower()
    if pattern == "*":
        return True
    if pattern.endswith("://*"):
        return origin.startswith(pattern[:-1]) and len(origin) > len(pattern) - 1
    if pattern.endswith(":*"):
        base = pattern[:-2]
        if origin == base:
            return True
        port = origin[len(base) + 1:] if origin.startswith(base + ":") else ""
        return port.isascii() and port.isdigit()
    return origin == pattern


def is_origin_allowed(origin: str, patterns: tuple[str, ...]) -> bool:
    """True when any allowed-origins entry matches."""
    return any(origin_matches(origin, pattern) for pattern in patterns)
