"""Streams that fail after they started, and clients that go away."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from strata.engine.api import create_app

from .conftest import parse_sse

USER = [{"role": "user", "content": "hi"}]


async def test_openai_stream_failing_midway_ends_with_error_event(client, service):
    service.fail_after = 3
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "stream": True})
    assert resp.status == 200
    events = [d for _, d in parse_sse(await resp.text())]
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "the engine fell over"
    assert events[-2]["error"]["type"] == "server_error"
    assert any(e != "[DONE]" and "choices" in e and e["choices"][0]["delta"].get("content")
               for e in events)


async def test_completions_stream_failing_midway(client, service):
    service.fail_after = 2
    resp = await client.post("/v1/completions", json={"prompt": "hi", "stream": True})
    events = [d for _, d in parse_sse(await resp.text())]
    assert events[-2]["error"]["code"] == "internal" and events[-1] == "[DONE]"


async def test_anthropic_stream_failing_midway_ends_with_error_event(client, service):
    service.fail_after = 3
    resp = await client.post("/v1/messages", json={"messages": USER, "stream": True,
                                                   "max_tokens": 50})
    events = parse_sse(await resp.text())
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error"
    assert data == {"type": "error", "error": {"type": "api_error",
                                               "message": "the engine fell over"}}
    assert "message_stop" not in [n for n, _ in events]


@pytest.fixture(params=[True, False], ids=["handler_cancelled", "write_fails"])
async def disconnect_url(request, service):
    """A server that cancels handlers on disconnect (aiohttp's test default) and one that does
    not (web.run_app's default), where only the next failed write tells the client is gone.
    """
    runner = web.AppRunner(create_app(service), handler_cancellation=request.param)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def _disconnect_midstream(url, service, path, body):
    service.is_endless = True
    service.token_delay_s = 0.005
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + path, json=body)
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the stream has started
        resp.close()  # drop the connection
    await asyncio.wait_for(service.closed_early.wait(), timeout=5)
    assert service.num_closed_early == 1


async def test_client_disconnect_closes_the_service_iterator(disconnect_url, service):
    await _disconnect_midstream(disconnect_url, service, "/v1/chat/completions",
                                {"messages": USER, "stream": True})


async def test_a_client_that_goes_away_is_logged(service, caplog):
    """The server cancels the handler of a client that left (listen.py), so aiohttp writes
    no access line for it: the log still says what became of the request."""
    runner = web.AppRunner(create_app(service), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        with caplog.at_level(logging.INFO, logger="strata.engine.api.errors"):
            await _disconnect_midstream(f"http://127.0.0.1:{runner.addresses[0][1]}", service,
                                        "/v1/chat/completions", {"messages": USER, "stream": True})
            for _ in range(100):  # the cancellation reaches the middleware a moment later
                if "went away" in caplog.text:
                    break
                await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert "POST /v1/chat/completions: the client went away after" in caplog.text


async def test_client_disconnect_on_anthropic_stream(disconnect_url, service):
    await _disconnect_midstream(disconnect_url, service, "/v1/messages",
                                {"messages": USER, "stream": True, "max_tokens": 400})


async def test_a_request_stopped_by_the_shutdown_is_not_logged_as_a_client_leaving(service,
                                                                                  caplog):
    """The server's shutdown cancels a handler still streaming, as a client's leaving does:
    the log line says the server stopped it, not that the client went away."""
    service.is_endless = True
    service.token_delay_s = 0.005
    runner = web.AppRunner(create_app(service), handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    with caplog.at_level(logging.INFO, logger="strata.engine.api.errors"):
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/v1/chat/completions",
                                      json={"messages": USER, "stream": True})
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the stream has started
            await runner.cleanup()  # the client is still reading
            resp.close()
    assert "POST /v1/chat/completions: the server shut down after" in caplog.text
    assert "went away" not in caplog.text
