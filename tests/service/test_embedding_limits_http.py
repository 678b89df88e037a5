"""Embeddings are bounded, fair to chats and cancellable (issue 51, item 3): `serve` with the
real engine process on a tiny llama (CPU). Order is read from the events the supervisor gets
from the engine, never from timings."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import pytest_asyncio
from fakes.tiny_model import write_tiny_model_dir

from strata.engine import protocol as p
from strata.engine.api.embedding_routes import MAX_EMBED_INPUTS, MAX_EMBED_TOKENS
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.serving import serving
from tests.snapshots.helpers import VOCAB, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

CONTEXT_TOKENS = 256
# Within the limits, and long for the tiny model: about 400 engine steps of embedding.
BIG_INPUT = [[5 + (i + j) % 300 for j in range(100)] for i in range(MAX_EMBED_INPUTS)]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tmp_path_factory):
    """serve() over a Service with the real engine; yields (base url, service)."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)
    settings = ServeSettings(model=str(model_dir), port=0, device="cpu",
                             context_tokens=CONTEXT_TOKENS,
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    service = Service(settings)
    async with serving(settings, service) as base_url:
        yield base_url, service


class EventLog:
    """The engine's events in the order the supervisor dispatches them (a spy that passes
    each on to the real dispatch), and the commands sent to it."""

    def __init__(self, supervisor, monkeypatch):
        self.events: list = []
        self.commands: list = []
        self.changed = asyncio.Event()
        dispatch, send = supervisor._dispatch, supervisor._send

        def spy_dispatch(handle, event):
            self.events.append(event)
            self.changed.set()
            dispatch(handle, event)

        def spy_send(handle, command, command_id=None):
            self.commands.append(command)
            self.changed.set()
            return send(handle, command, command_id)

        monkeypatch.setattr(supervisor, "_dispatch", spy_dispatch)
        monkeypatch.setattr(supervisor, "_send", spy_send)

    async def until(self, found, timeout_s: float = 120.0):
        async with asyncio.timeout(timeout_s):
            while not (result := found()):
                self.changed.clear()
                await self.changed.wait()
        return result


def is_embed_end(event) -> bool:
    """The event that ends an embedding in the engine: its Done (or, before issue 51, the one
    Embeddings answer)."""
    return (isinstance(event, p.Done) and event.request_id.startswith("embed-")) or (
        isinstance(event, p.Embeddings) and not hasattr(event, "request_id"))


async def post(session, url, body):
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_over_limit_inputs_are_a_413_naming_the_limit(server):
    base, service = server
    too_many = [[5]] * (MAX_EMBED_INPUTS + 1)
    too_long = [[5 + j % 300 for j in range(CONTEXT_TOKENS)]] * (
        MAX_EMBED_TOKENS // CONTEXT_TOKENS + 1)
    async with aiohttp.ClientSession() as session:
        for path, field in (("/v1/embeddings", "input"), ("/embeddings", "input"),
                            ("/embedding", "content"), ("/api/embed", "input")):
            body = {"model": service.model_id, field: too_many} if path == "/api/embed" else {field: too_many}
            status, answer = await post(session, base + path, body)
            assert status == 413, (path, answer)
            assert f"at most {MAX_EMBED_INPUTS}" in str(answer), answer
            body[field] = too_long
            status, answer = await post(session, base + path, body)
            assert status == 413, (path, answer)
            assert f"at most {MAX_EMBED_TOKENS}" in str(answer), answer
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError, match=f"at most {MAX_EMBED_INPUTS}") as refused:
        await client.embeddings.create(model=service.model_id, input=["w5"] * (MAX_EMBED_INPUTS + 1))
    assert refused.value.status_code == 413


async def test_a_chat_gets_its_tokens_while_a_long_embedding_runs(server, monkeypatch):
    base, service = server
    await service.control("load")
    log = EventLog(service.supervisor, monkeypatch)
    async with aiohttp.ClientSession() as session:
        embedding = asyncio.create_task(post(session, f"{base}/v1/embeddings",
                                             {"input": BIG_INPUT}))
        # The engine has begun the embedding (its first vectors came back) ...
        await log.until(lambda: any(isinstance(e, p.Embeddings) for e in log.events))
        # ... when a chat comes: it decodes between the embedding's steps.
        chat = {"messages": [{"role": "user", "content": "w5 w9"}], "max_tokens": 4,
                "temperature": 0}
        status, answer = await post(session, f"{base}/v1/chat/completions", chat)
        assert status == 200, answer
        status, vectors = await embedding
        assert status == 200 and len(vectors["data"]) == MAX_EMBED_INPUTS
    first_token = next(i for i, e in enumerate(log.events) if isinstance(e, p.Tokens))
    embedding_end = next(i for i, e in enumerate(log.events) if is_embed_end(e))
    assert first_token < embedding_end
    steps = [e for e in log.events if isinstance(e, p.Embeddings)]
    assert len(steps) > 1 and sum(len(e.vectors) for e in steps) == MAX_EMBED_INPUTS


async def test_a_client_that_leaves_cancels_the_rest_and_the_engine_serves_on(
        server, monkeypatch):
    base, service = server
    await service.control("load")
    supervisor = service.supervisor
    pid, starts, crashes = supervisor.pid, supervisor.num_starts, supervisor.num_crashes
    log = EventLog(supervisor, monkeypatch)
    session = aiohttp.ClientSession()
    request = asyncio.create_task(post(session, f"{base}/v1/embeddings", {"input": BIG_INPUT}))
    await log.until(lambda: any(isinstance(c, p.Embed) for c in log.commands))
    request.cancel()  # the client leaves: its connection closes
    await session.close()
    # The engine stops the remaining inputs: Done(cancelled) before all vectors were made.
    end = await log.until(lambda: next((e for e in log.events if is_embed_end(e)), None))
    assert isinstance(end, p.Done) and end.usage.finish_reason == "cancelled"
    made = sum(len(e.vectors) for e in log.events if isinstance(e, p.Embeddings))
    assert made < MAX_EMBED_INPUTS
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    answer = await client.embeddings.create(model=service.model_id, input=["w5 w9", "w7"])
    assert len(answer.data) == 2
    assert (supervisor.pid, supervisor.num_starts, supervisor.num_crashes) == (
        pid, starts, crashes)
    assert service.status()["state"] == "loaded"
