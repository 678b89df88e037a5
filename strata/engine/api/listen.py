"""Bind the API for `strata serve` and the tray alike: one function, so the two cannot drift.

It picks the Host names to accept for the bind address (never '*' on its own: a wildcard bind
accepts this machine's names and addresses, so DNS rebinding stays shut), builds the app, binds,
warns when the API is reachable from other machines without a key, and logs the real address.
"""

from __future__ import annotations

import asyncio
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
_FQDN_TIMEOUT_S = 2.0  # getfqdn asks DNS; a machine without a resolver must not stall start-up


class ListenError(StrataError):
    """The API could not bind its address; the message says what to do."""


@dataclass
class Listening:
    """A bound API: the runner (to clean up), the /v1 URL for clients, the bound addresses."""

    runner: web.AppRunner
    endpoint_url: str
    bound: tuple[str, ...]  # 'host:port' per listening socket, the real port when 0 was asked


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
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
        if bind_host not in WILDCARD_HOSTS:
            names.append(normalize_host_name(bind_host))
        names.extend(sorted(await machine_host_names()))
    return tuple(dict.fromkeys(n for n in names if n))


def _bound_addresses(runner: web.AppRunner) -> tuple[str, ...]:
    bound = []
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            host = str(address[0])
            bound.append(f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}")
    return tuple(bound)


def _client_host(bind_host: str) -> str:
    if bind_host in WILDCARD_HOSTS:
        return "127.0.0.1"
    return f"[{bind_host}]" if ":" in bind_host else bind_host


async def start_listening(service: Any, settings: Any, *, port_advice: str = "--port"
                          ) -> Listening:
    """Build the API over `service` with settings' key, hosts and origins; bind host:port.

    handler_cancellation: a client that goes away cancels its handler at once, so its
    generation stops even while it waits in the queue or in a long prefill.
    Raises ListenError (runner cleaned up) when the address cannot be bound.
    """
    allowed_hosts = await allowed_hosts_for_bind(settings.host, settings.allowed_hosts)
    app = create_app(service, api_key=settings.api_key, allowed_hosts=allowed_hosts,
                     allowed_origins=settings.allowed_origins)
    runner = web.AppRunner(app, handler_cancellation=True, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError(f"cannot listen on {settings.host}:{settings.port} "
                          f"({exc.strerror or exc}); pick another port with {port_advice}"
                          ) from None
    bound = _bound_addresses(runner)
    port = int(bound[0].rsplit(":", 1)[1]) if bound else settings.port
    url = f"http://{_client_host(settings.host)}:{port}/v1"
    log.info("listening on %s", ", ".join(bound) or f"{settings.host}:{port}")
    if "*" in allowed_hosts:
        log.warning("allowed-hosts has '*': any Host header is accepted, which lets web pages "
                    "reach this server through DNS rebinding")
    if not is_loopback(settings.host) and not settings.api_key:
        log.warning("listening beyond this machine (%s) without an API key: anyone who can "
                    "reach it can use, unload and reconfigure the model; set api-key in the "
                    "config file or STRATA_API_KEY", settings.host or "all interfaces")
    return Listening(runner, url, bound)
