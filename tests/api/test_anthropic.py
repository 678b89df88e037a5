"""Anthropic /v1/messages and /v1/messages/count_tokens."""

from __future__ import annotations

from .conftest import parse_sse
from .fake_service import CACHED_TOKENS

MESSAGES = {"model": "x", "max_tokens": 64, "system": "You are a helpful assistant.",
            "messages": [{"role": "user", "content": "What is the answer?"}]}


async def test_messages_non_stream(client, service, text_assets):
    resp = await client.post("/v1/messages", json=MESSAGES)
    assert resp.status == 200
    body = await resp.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": service.reply_text}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    prompt_ids = service.requests[0].prompt_ids
    assert list(prompt_ids) == text_assets.encode_chat(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is the answer?"}])
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] == \
        len(prompt_ids)
    assert body["usage"]["cache_read_input_tokens"] == CACHED_TOKENS
    assert body["usage"]["output_tokens"] == len(service.reply_ids())


async def test_messages_stop_sequence_and_max_tokens(client, service):
    body = await (await client.post("/v1/messages", json={
        **MESSAGES, "stop_sequences": ["zzz", "answer"]})).json()
    assert body["content"][0]["text"] == "Hello world! The "
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "answer")
    body = await (await client.post("/v1/messages", json={**MESSAGES, "max_tokens": 2})).json()
    assert body["stop_reason"] == "max_tokens"


async def test_messages_accept_text_blocks(client, service, text_assets):
    resp = await client.post("/v1/messages", json={
        **MESSAGES, "system": [{"type": "text", "text": "Sys."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": "Hello"},
                     {"role": "user", "content": "Again"}]})
    assert resp.status == 200
    assert list(service.requests[0].prompt_ids) == text_assets.encode_chat(
        [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}])


async def test_messages_stream_event_sequence(client, service):
    resp = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = parse_sse(await resp.text())
    names = [name for name, _ in events]
    num_deltas = names.count("content_block_delta")
    assert num_deltas >= 2
    assert names == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(service.requests[0].prompt_ids)
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == service.reply_text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(service.reply_ids())


async def test_count_tokens_matches_the_prompt_sent_to_generate(client, service):
    body = await (await client.post("/v1/messages/count_tokens", json={
        "model": "x", "system": MESSAGES["system"], "messages": MESSAGES["messages"]})).json()
    await client.post("/v1/messages", json=MESSAGES)
    assert body == {"input_tokens": len(service.requests[0].prompt_ids)}
    assert [c[0] for c in service.calls] == ["generate"]  # counting generated nothing
