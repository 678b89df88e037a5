"""Bind the HTTP port before the model loads, so a port in use is a one-line error at once.

`strata serve` and the tray both bind here first and hand the sockets to aiohttp (SockSite)
once the service is up: no window between a check and the real bind for another program to
take the port, and no minute of loading before finding out it was taken.
"""

from __future__ import annotations

import contextlib
import socket

from strata.errors import StrataError

BACKLOG = 128  # aiohttp's default for TCPSite


class PortInUseError(StrataError):
    """host:port cannot be bound; the message says why and what to do."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address of host:port, as TCPSite binds them.

    Listening at once (not just bound) makes the port ours: another server bound with
    SO_REUSEADDR could otherwise share it until one of us listens. A client that connects
    during the load waits in the backlog and is answered once the API is up.

    Port 0 picks one free port, shared by every address. Raises PortInUseError (one line).
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                             "check --host") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, str]] = set()
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
            sock.listen(BACKLOG)
    except OSError as exc:
        close_sockets(sockets)
        raise PortInUseError(f"cannot listen on {host}:{port} ({exc.strerror}); "
                             "pick another port with --port or `port` in the config file") from None
    return sockets


def close_sockets(sockets: list[socket.socket]) -> None:
    """Close sockets that were never handed to aiohttp (start-up failed or was interrupted)."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.close()


def bound_port(sockets: list[socket.socket], fallback: int) -> int:
    """The port the sockets hold (the real one when port 0 was asked for)."""
    return int(sockets[0].getsockname()[1]) if sockets else fallback
