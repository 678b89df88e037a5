"""Strata's OpenAI answers validate against OpenAI's own published schemas.

tests/api/data/openai_schemas.json is cut from OpenAI's OpenAPI spec (see the extract script
beside it); clients generated from that spec reject what it does not allow.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest

from .conftest import parse_sse

DATA = Path(__file__).with_name("data") / "openai_schemas.json"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}


def _nullable(node: object) -> object:
    """OpenAPI 3.0's `nullable: true`, which the spec still uses in places, as JSON Schema."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache
def _components() -> dict:
    return _nullable(json.loads(DATA.read_text())["components"])


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": _components()}
    return jsonschema.Draft202012Validator(schema)


def event_schema(event_type: str) -> str:
    """The member of ResponseStreamEvent whose `type` is event_type (a clearer error than
    'not valid under any of the given schemas')."""
    schemas = _components()["schemas"]
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[1]
        if schemas[name].get("properties", {}).get("type", {}).get("enum") == [event_type]:
            return name
    raise AssertionError(f"OpenAI's spec has no stream event {event_type!r}")


def check(name: str, payload: dict) -> None:
    errors = sorted(_validator(name).iter_errors(payload), key=lambda e: list(e.path))
    assert not errors, f"{name}: " + "; ".join(
        f"{'/'.join(map(str, e.path)) or '(top)'}: {e.message[:200]}" for e in errors[:5])


async def test_chat_completion(client):
    answer = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    check("CreateChatCompletionResponse", answer)
    assert answer["system_fingerprint"].startswith("fp_strata_")


async def test_chat_completion_chunks(client):
    response = await client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [data for _, data in parse_sse(await response.text()) if data != "[DONE]"]
    assert len(chunks) > 3
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)


async def test_completion(client):
    check("CreateCompletionResponse", await (await client.post(
        "/v1/completions", json={"prompt": "The", "max_tokens": 4})).json())


async def test_models(client, service):
    check("ListModelsResponse", await (await client.get("/v1/models")).json())
    check("Model", await (await client.get(f"/v1/models/{service.model_id}")).json())


@pytest.mark.parametrize("max_output_tokens", [64, 2])  # completed, and incomplete
async def test_response(client, max_output_tokens):
    check("Response", await (await client.post("/v1/responses", json={
        "input": "hi", "max_output_tokens": max_output_tokens})).json())


async def test_response_stream_events(client):
    response = await client.post("/v1/responses", json={"input": "hi", "stream": True})
    events = parse_sse(await response.text())
    assert len(events) > 8
    for name, data in events:
        assert data["type"] == name
        check(event_schema(name), data)


async def test_response_with_function_calls(aiohttp_client, service):
    """Function call items and their stream events, on Qwen3's template and its call format."""
    import dataclasses

    from strata.engine.api import create_app

    from .test_responses_tools import CALL_TEXT, TEMPLATES, WEATHER

    service.text = dataclasses.replace(service.text,
                                       chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    service.context_tokens, service.reply_text = 8192, CALL_TEXT
    client = await aiohttp_client(create_app(service))
    body = {"input": "Weather?", "tools": [WEATHER], "max_output_tokens": 200}
    answer = await (await client.post("/v1/responses", json=body)).json()
    assert [item["type"] for item in answer["output"]] == ["function_call"] * 2
    check("Response", answer)
    events = parse_sse(await (await client.post("/v1/responses",
                                                 json={**body, "stream": True})).text())
    assert "response.function_call_arguments.delta" in [name for name, _ in events]
    for name, data in events:
        check(event_schema(name), data)
