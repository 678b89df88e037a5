"""The official `ollama` Python client, unchanged, against the app on a real port."""

from __future__ import annotations

import json

import ollama
import pytest

from strata.engine.api import create_app
from strata.engine.api.ollama_params import parse_keep_alive


@pytest.fixture
async def host(aiohttp_server, service):
    server = await aiohttp_server(create_app(service))
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
def name(service) -> str:
    return f"{service.model_id}:latest"


async def test_listing_routes(host, service, name):
    client = ollama.AsyncClient(host=host)
    listed = await client.list()
    assert [m.model for m in listed.models] == [name]
    assert listed.models[0].details.format == "hf"
    assert listed.models[0].size > 0
    shown = await client.show(name)
    assert shown.template == service.text.chat_template
    assert shown.capabilities == ["completion", "tools"]  # no <think> in its template
    running = await client.ps()
    assert [m.model for m in running.models] == [name]
    service.state = "unloaded"
    assert (await client.ps()).models == []


async def test_chat_not_streamed(host, service, name):
    client = ollama.AsyncClient(host=host)
    reply = await client.chat(model=name, messages=[{"role": "user", "content": "hi"}],
                              stream=False, options={"temperature": 0, "num_predict": 64,
                                                     "repeat_penalty": 1.1,
                                                     "presence_penalty": 0.5})
    assert reply.message.role == "assistant"
    assert reply.message.content == service.reply_text
    assert reply.done and reply.done_reason == "stop"
    assert reply.eval_count == len(service.reply_ids())
    assert reply.prompt_eval_count > 0
    sampling = service.requests[-1].sampling
    assert sampling.temperature == 0 and sampling.max_tokens == 64
    assert sampling.repeat_penalty == 1.1 and sampling.presence_penalty == 0.5


async def test_chat_streamed_with_a_stop(host, service, name):
    client = ollama.AsyncClient(host=host)
    pieces, final = [], None
    async for part in await client.chat(model=service.model_id, stream=True,
                                        messages=[{"role": "user", "content": "hi"}],
                                        options={"stop": ["42"]}):
        if part.done:
            final = part
        else:
            pieces.append(part.message.content)
    assert "".join(pieces) == "Hello world! The answer is "
    assert final is not None and final.done_reason == "stop" and final.eval_count > 0


async def test_generate_and_the_load_only_request(host, service, name):
    client = ollama.AsyncClient(host=host)
    reply = await client.generate(model=name, prompt="Say hello", system="Be brief.",
                                  stream=False, options={"num_predict": 3})
    assert reply.done_reason == "length"
    assert reply.response == service.text.decode(service.reply_ids()[:3])
    assert reply.eval_count == 3
    loaded = await client.generate(model=name, prompt="", keep_alive="10m")
    assert loaded.done_reason == "load"
    assert ("control", "load", {}) in service.calls
    assert ("set_unload_idle", 600.0) in service.calls
    unloaded = await client.generate(model=name, prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert ("control", "unload", {}) in service.calls


async def test_keep_alive_zero_unloads_after_the_answer(host, service, name):
    client = ollama.AsyncClient(host=host)
    await client.chat(model=name, messages=[{"role": "user", "content": "hi"}], keep_alive=0)
    assert service.calls[-1] == ("control", "unload", {})
    await client.chat(model=name, messages=[{"role": "user", "content": "hi"}], keep_alive=-1)
    assert ("set_unload_idle", None) in service.calls


@pytest.mark.parametrize(("body", "words"), [
    ({"model": "llama3:latest", "messages": [{"role": "user", "content": "hi"}]},
     "model 'llama3:latest' not found"),
    ({"messages": [{"role": "user", "content": "hi"}], "options": {"num_gpu": 1}},
     "options 'num_gpu' are not supported"),
    ({"messages": [{"role": "user", "content": "hi"}], "format": {"not": {"type": "string"}}},
     "not"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
     "has 'images'"),
    ({"messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"},
     "'keep_alive' is 'soon'"),
    ({"messages": [{"role": "user", "content": "hi"}], "think": True}, "'think'"),
])
async def test_refusals_are_ollama_shaped(host, service, name, body, words):
    client = ollama.AsyncClient(host=host)
    with pytest.raises(ollama.ResponseError) as raised:
        await client.chat(**{"model": name, **body})
    assert words in raised.value.error
    assert raised.value.status_code in (400, 404)
    assert not service.requests  # nothing was generated


async def test_ndjson_lines_and_errors_on_the_wire(client, service):
    response = await client.post("/api/chat", json={
        "model": service.model_id, "messages": [{"role": "user", "content": "hi"}]})
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in (await response.text()).splitlines()]
    assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
    missing = await client.post("/api/show", json={"model": "nope"})
    assert missing.status == 404 and set(await missing.json()) == {"error"}
    assert (await (await client.get("/api/version")).json())["version"]


async def test_a_failure_mid_stream_ends_with_an_error_line(client, service):
    service.fail_after = 2
    response = await client.post("/api/chat", json={
        "model": service.model_id, "messages": [{"role": "user", "content": "hi"}]})
    lines = [json.loads(line) for line in (await response.text()).splitlines()]
    assert "error" in lines[-1] and not any(line.get("done") for line in lines)


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (0, 0.0), (-1, -1.0), ("-1", -1.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("250ms", 0.25), ("10", 10.0), (2.5, 2.5)])
def test_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("fmt", ["json", {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}])
async def test_format_is_enforced_by_a_grammar(client, service, fmt) -> None:
    """Ollama's `format` reaches the engine as a grammar (before: a 400)."""
    resp = await client.post("/api/chat", json={
        "model": service.model_id, "stream": False, "format": fmt,
        "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200, await resp.text()
    assert service.requests[-1].sampling.grammar is not None


async def test_an_unknown_format_is_a_400(client, service) -> None:
    resp = await client.post("/api/chat", json={
        "model": service.model_id, "format": "xml",
        "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 400 and "'format' must be" in (await resp.json())["error"]
