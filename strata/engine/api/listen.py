"""Bind the API for `strata serve` and the tray alike: one function, so the two cannot drift.

It picks the Host names to accept for the bind address (never '*' on its own: a wildcard bind
accepts this machine's names and addresses, so DNS rebinding stays shut), builds the app, binds,
warns when the API is reachable from other machines without a key, and logs the real address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import psutil
from aiohttp import web

from strata.engine.api.app import create_app
from strata.engine.api.keys import LOOPBACK_HOSTS
from strata.engine.api.origins import normalize_host_name
from strata.errors import StrataError

log = logging.getLogger(__name__)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_BACKLOG = 128  # aiohttp's default for TCPSite
_FQDN_TIMEOUT_S = 2.0  # getfqdn asks DNS; a machine without a resolver must not stall start-up


class ListenError(StrataError):
    """The API could not bind its address; the message says what to do."""


@dataclass
class Listening:
    """A bound API: the runner (to clean up), the /v1 URL for clients, the bound addresses."""

    runner: web.AppRunner
    endpoint_url: str
    bound: tuple[str, ...]  # 'host:port' per listening socket, the real port when 0 was asked


def bind_hosts(host: str) -> list[str]:
    """The addresses of a --host value: one, or several separated by commas (as llama-server
    takes them: '127.0.0.1,::1'); '' stays the wildcard."""
    parts = [part.strip() for part in host.split(",")]
    return [part for part in parts if part] or [""]


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1); for several addresses,
    when every one is."""
    hosts = bind_hosts(host)
    if len(hosts) > 1:
        return all(is_loopback(one) for one in hosts)
    name = normalize_host_name(host)
    if name in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def interface_addresses() -> set[str]:
    """Every IPv4/IPv6 address of this machine's network interfaces."""
    addresses = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6) and entry.address:
                addresses.add(normalize_host_name(entry.address))
    return addresses


async def machine_host_names() -> set[str]:
    """This machine's host name, its fully qualified name and its interface addresses."""
    names = {socket.gethostname()}
    try:
        names.add(await asyncio.wait_for(asyncio.to_thread(socket.getfqdn), _FQDN_TIMEOUT_S))
    except (TimeoutError, OSError):
        log.info("no fully qualified host name within %.0f s; accepting %s without it",
                 _FQDN_TIMEOUT_S, socket.gethostname())
    return {normalize_host_name(n) for n in names if n} | interface_addresses()


async def allowed_hosts_for_bind(bind_host: str, extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Host names the API accepts, besides the loopback names that it always accepts.

    A bind beyond loopback adds the bind address and this machine's own names and addresses;
    `extra` (--allowed-hosts) adds more, such as host.docker.internal, or '*' for any.
    """
    names = [normalize_host_name(h) for h in extra]
    if not is_loopback(bind_host):
        names += [normalize_host_name(one) for one in bind_hosts(bind_host)
                  if one not in WILDCARD_HOSTS]
        names.extend(sorted(await machine_host_names()))
    return tuple(dict.fromkeys(n for n in names if n))


def _bound_addresses(runner: web.AppRunner) -> tuple[str, ...]:
    bound = []
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            host = str(address[0])
            bound.append(f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}")
    return tuple(bound)


def client_host(bind_host: str, bound: Iterable[str]) -> str:
    """The host a client on this machine uses for a bind: a wildcard bind's loopback in a
    family it listens on ('::' binds IPv6 only, where 127.0.0.1 is refused), else the bind
    address itself, bracketed when IPv6."""
    bind_host = bind_hosts(bind_host)[0]
    if bind_host in WILDCARD_HOSTS:
        has_ipv4 = any(not address.startswith("[") for address in bound)
        return "127.0.0.1" if has_ipv4 or not bound else "[::1]"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


def bind_sockets(host: str, port: int, *, port_advice: str = "--port") -> list[socket.socket]:
    """Listening sockets for every address of host:port, as TCPSite would bind them, made
    before the model loads: a port in use is a one-line error at once, not after the load, and
    nothing can take the port between a check and the bind. Port 0 picks one free port for
    every address. A client that connects during the load waits in the backlog.

    Raises ListenError (one line).
    """
    try:
        infos = [info for one in bind_hosts(host)
                 for info in socket.getaddrinfo(one or None, port, type=socket.SOCK_STREAM,
                                                flags=socket.AI_PASSIVE)]
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host"
                          ) from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, str | int]] = set()  # (family, host); getaddrinfo types it str | int
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            if sockets:  # port 0: every address gets the port the first one got
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            # Listening at once makes the port ours: another server bound with SO_REUSEADDR
            # could share it until one of us listens.
            sock.listen(_BACKLOG)
    except OSError as exc:
        close_sockets(sockets)
        raise ListenError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                          f"pick another port with {port_advice}") from None
    return sockets


def close_sockets(sockets: Iterable[socket.socket]) -> None:
    """Close sockets (start-up failed or was interrupted; closing twice is harmless)."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()


async def start_listening(service: Any, settings: Any, *, port_advice: str = "--port",
                          sockets: list[socket.socket] | None = None) -> Listening:
    """Build the API over `service` with settings' key, hosts and origins; bind host:port,
    or serve on `sockets` that bind_sockets() bound before the model loaded.

    handler_cancellation: a client that goes away cancels its handler at once, so its
    generation stops even while it waits in the queue or in a long prefill.
    Raises ListenError (runner cleaned up) when the address cannot be bound.
    """
    allowed_hosts = await allowed_hosts_for_bind(settings.host, settings.allowed_hosts)
    app = create_app(service, api_key=settings.api_key, allowed_hosts=allowed_hosts,
                     allowed_origins=settings.allowed_origins,
                     metrics_endpoint=settings.metrics_endpoint,
                     slots_endpoint=settings.slots_endpoint,
                     embedding_pooling=settings.embedding_pooling)
    runner = web.AppRunner(app, handler_cancellation=True, handle_signals=False)
    await runner.setup()
    try:
        for host in bind_hosts(settings.host) if sockets is None else ():
            await web.TCPSite(runner, host, settings.port).start()
        for sock in sockets or ():
            await web.SockSite(runner, sock).start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); pick another port with {port_advice}"
                          ) from None
    bound = _bound_addresses(runner)
    port = int(bound[0].rsplit(":", 1)[1]) if bound else settings.port
    url = f"http://{client_host(settings.host, bound)}:{port}/v1"
    log.info("listening on %s", ", ".join(bound) or f"{settings.host}:{port}")
    if "*" in allowed_hosts:
        log.warning("allowed-hosts has '*': any Host header is accepted, which lets web pages "
                    "reach this server through DNS rebinding")
    if "*" in settings.allowed_origins:
        log.warning("allowed-origins has '*': any web page the user opens can call this "
                    "server and read its answers; name the origins that need it instead")
    if not is_loopback(settings.host) and not settings.api_key:
        log.warning("listening beyond this machine (%s) without an API key: anyone who can "
                    "reach it can use, unload and reconfigure the model; set api-key in the "
                    "config file or STRATA_API_KEY", settings.host or "all interfaces")
    return Listening(runner, url, bound)
