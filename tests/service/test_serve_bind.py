"""Binding beyond loopback (issue 17 item 1): a wildcard bind keeps checking Host (this machine's
names and addresses, loopback and --allowed-hosts, never '*'), warns without an API key and logs
the real bound address. `strata serve` and the tray bind through the same function, so the tray
gets the same checks and cancels the handler of a client that went away.

Real serve()/Host.start_server (the tray's), Service, Supervisor and engine process loop (fake engine).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket

import aiohttp
import psutil
import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.host.root import Host
from tests.helpers.serving import serving

pytestmark = pytest.mark.timeout(90)


def _service(model_dir, settings, **engine) -> Service:
    return Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                   engine_config=FakeEngineConfig(model_path=str(model_dir), **engine))


def _serving(model_dir, settings):
    """serve() over the fake engine until the block ends; yields the base URL (no /v1). The
    fake engine starts and stops at once: 20 s for each is ample."""
    return serving(settings, _service(model_dir, settings), start_timeout_s=20,
                   stop_timeout_s=20)


def _interface_address() -> str:
    """A non-loopback IPv4 address of this machine, else any of its addresses."""
    addresses = [a.address for entries in psutil.net_if_addrs().values() for a in entries
                 if a.family == socket.AF_INET]
    return next((a for a in addresses if not a.startswith("127.")), addresses[0])


async def _status_for_host(base: str, host: str) -> int:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{base}/v1/models", headers={"Host": host}) as response:
        return response.status


async def _check_hosts(base: str, port: int) -> None:
    for host, expected in [
        ("evil.example", 403), (f"evil.example:{port}", 403), ("127.0.0.1.nip.io", 403),
        (f"localhost:{port}", 200), (f"{socket.gethostname()}:{port}", 200),
        (f"{_interface_address()}:{port}", 200), (f"host.docker.internal:{port}", 200),
    ]:
        assert await _status_for_host(base, host) == expected, host


async def test_wildcard_serve_checks_host_warns_and_logs_the_real_port(tiny_model_dir, caplog):
    settings = ServeSettings(model=str(tiny_model_dir), host="0.0.0.0", port=0,
                             allowed_hosts=("host.docker.internal",))
    caplog.set_level(logging.INFO)
    async with _serving(tiny_model_dir, settings) as base:
        port = int(base.rsplit(":", 1)[1])
        assert port != 0
        await _check_hosts(base, port)
        log = caplog.text
        assert re.search(rf"listening on 0\.0\.0\.0:{port}\b", log), log
        assert "without an API key" in log


async def test_loopback_serve_with_a_key_gives_no_warning(tiny_model_dir, caplog):
    settings = ServeSettings(model=str(tiny_model_dir), port=0, api_key="k")
    caplog.set_level(logging.INFO)
    async with _serving(tiny_model_dir, settings):
        pass
    assert "without an API key" not in caplog.text


async def test_an_ipv6_wildcard_bind_announces_an_address_that_answers(tiny_model_dir, caplog):
    # '::' listens on IPv6 only (IPV6_V6ONLY): 127.0.0.1 would be refused (issue 51 item 7).
    settings = ServeSettings(model=str(tiny_model_dir), host="::", port=0, api_key="k",
                             allowed_origins=("*",))
    caplog.set_level(logging.INFO)
    async with _serving(tiny_model_dir, settings) as base:
        assert base.startswith("http://[::1]:"), base
        async with aiohttp.ClientSession() as session, \
                session.get(base + "/health") as response:
            assert response.status == 200
        assert "allowed-origins has '*'" in caplog.text


async def test_the_tray_binds_like_serve(tiny_model_dir):
    settings = ServeSettings(model=str(tiny_model_dir), host="0.0.0.0", port=0,
                             allowed_hosts=("host.docker.internal",))
    service = _service(tiny_model_dir, settings, token_delay_s=0.05)
    tray = await Host(settings).start_server(service=service)
    try:
        base = tray.endpoint_url.removesuffix("/v1")
        await _check_hosts(base, int(base.rsplit(":", 1)[1]))
        # A client that gives up cancels its (non-streaming) generation at once.
        body = {"prompt": "w5 w6", "max_tokens": 3000}  # 150 s at 50 ms a token
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(f"{tray.endpoint_url}/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=1.5)):
                    pass
        for _ in range(100):
            if not service.status()["is_busy"]:
                break
            await asyncio.sleep(0.05)
        assert not service.status()["is_busy"], "the abandoned generation is still running"
    finally:
        await tray.stop()


async def test_several_addresses_are_bound_and_all_answer(tiny_model_dir, caplog):
    """--host 127.0.0.1,::1 (llama-server's comma list): one port on both, both answer, and
    loopback only, so no warning about other machines."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    settings = ServeSettings(model=str(tiny_model_dir), host="127.0.0.1,::1", port=0)
    caplog.set_level(logging.INFO)
    async with _serving(tiny_model_dir, settings) as first:
        assert first.startswith("http://127.0.0.1:"), first
        port = int(first.rsplit(":", 1)[1])
        async with aiohttp.ClientSession() as session:
            for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
                async with session.get(f"{base}/health") as response:
                    assert response.status == 200, base
        assert "without an API key" not in caplog.text
