"""OpenAI routes over the real app, a real tokenizer and the fake service."""

from __future__ import annotations

from .conftest import parse_sse
from .fake_service import CACHED_TOKENS

CHAT = {"model": "x", "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                   {"role": "user", "content": "What is the answer?"}]}


async def test_chat_completion_returns_the_reply_and_usage(client, service, text_assets):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny-test-model" and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": service.reply_text,
                                 "refusal": None}
    assert choice["finish_reason"] == "stop"
    prompt_ids = service.requests[0].prompt_ids
    assert list(prompt_ids) == text_assets.encode_chat(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is the answer?"}])
    num_reply = len(service.reply_ids())
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": num_reply,
                             "total_tokens": len(prompt_ids) + num_reply,
                             "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS}}


async def test_chat_request_reaches_the_service_as_typed_sampling(client, service, text_assets):
    body = {**CHAT, "messages": [{"role": "developer", "content": [
        {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Very."}]},
        {"role": "user", "content": "hi"}], "max_completion_tokens": 7, "temperature": 0.5,
        "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11, "id_slot": 2}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    request = service.requests[0]
    assert request.slot == 2
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == \
        (7, 0.5, 0.9, 20, 0.05, 11)
    assert set(text_assets.eos_token_ids) <= set(s.stop_token_ids)
    assert list(request.prompt_ids) == text_assets.encode_chat(
        [{"role": "system", "content": "Be brief.\nVery."}, {"role": "user", "content": "hi"}])


async def test_max_tokens_reached_gives_finish_reason_length(client, service):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    body = await resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


async def test_chat_stream_sends_role_first_then_deltas_then_done(client, service):
    resp = await client.post("/v1/chat/completions",
                             json={**CHAT, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = [data for _, data in parse_sse(await resp.text())]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == service.reply_text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(service.reply_ids())
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED_TOKENS


async def test_stream_without_include_usage_has_no_usage_chunk(client):
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [data for _, data in parse_sse(await resp.text())]
    assert events[-1] == "[DONE]"
    assert all(c["choices"] for c in events[:-1])


async def test_stop_string_split_across_tokens_cuts_text_and_cancels(client, service,
                                                                     text_assets):
    # The stop string spans several tokens, so the matcher must hold text back across pushes.
    pieces = [text_assets.decode([i]) for i in text_assets.encode(service.reply_text,
                                                                  add_special=False)]
    assert not any("er is 4" in p for p in pieces)
    resp = await client.post("/v1/chat/completions",
                             json={**CHAT, "stop": ["er is 4", "zzz"]})
    body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "Hello world! The answ"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert service.num_closed_early == 1  # the stop hit closed the service's iterator


async def test_stop_string_in_stream(client, service):
    resp = await client.post("/v1/chat/completions",
                             json={**CHAT, "stream": True, "stop": "world"})
    events = [d for _, d in parse_sse(await resp.text())]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1])
    assert text == "Hello "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert service.num_closed_early == 1


async def test_multibyte_reply_survives_byte_level_splits(client, service):
    service.reply_text = "héllo wörld ✓ café"
    body = await (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert body["choices"][0]["message"]["content"] == "héllo wörld ✓ café"


async def test_completions_non_stream_and_stream(client, service, text_assets):
    resp = await client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 50})
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == service.reply_text
    assert list(service.requests[0].prompt_ids) == text_assets.encode("The quick")
    resp = await client.post("/v1/completions", json={"prompt": "The quick", "stream": True})
    events = [d for _, d in parse_sse(await resp.text())]
    assert events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == service.reply_text
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_completions_accepts_token_ids(client, service):
    resp = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
    assert resp.status == 200
    assert service.requests[0].prompt_ids == (5, 6, 7)


async def test_models_lists_the_model_with_its_state(client, service):
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "tiny-test-model"
    assert body["data"][0]["status"] == "loaded"
    for state, word in [("sleeping", "sleeping"), ("unloaded", "unloaded"),
                        ("failed", "unloaded")]:
        service.state = state
        body = await (await client.get("/v1/models")).json()
        assert body["data"][0]["status"] == word
    resp = await client.get("/v1/models/tiny-test-model")
    assert (await resp.json())["id"] == "tiny-test-model"
    assert (await client.get("/v1/models/other")).status == 404


