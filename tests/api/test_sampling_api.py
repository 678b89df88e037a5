"""Sampling defaults, penalties, logit_bias, logprobs and n through the real routes (fake
engine behind them): what each request field becomes in the engine's SamplingSpec."""

from __future__ import annotations

from strata.engine.text.sampling_defaults import resolve_sampling_defaults

from .conftest import parse_sse

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


async def sampling_of(client, service, path: str, body: dict):
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    return service.requests[-1].sampling


async def test_a_request_without_sampling_fields_gets_the_server_defaults(client, service):
    service.sampling_defaults = resolve_sampling_defaults({"temperature": 0.6}, {"top_k": 7})
    for path, body in ((CHAT, {"messages": USER}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/messages", {"messages": USER, "max_tokens": 5})):
        spec = await sampling_of(client, service, path, body)
        assert (spec.temperature, spec.top_k, spec.top_p, spec.min_p) == (0.6, 7, 0.95, 0.05)
        assert (spec.repeat_penalty, spec.penalty_last_n) == (1.0, 64)


async def test_explicit_values_win_over_the_defaults(client, service):
    body = {"messages": USER, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    spec = await sampling_of(client, service, CHAT, body)
    assert (spec.temperature, spec.top_k, spec.top_p, spec.min_p) == (1.0, 0, 1.0, 0.0)


async def test_penalties_and_logit_bias_reach_the_engine(client, service):
    spec = await sampling_of(client, service, CHAT, {
        "messages": USER, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "repeat_last_n": -1, "logit_bias": {"3": -100, "4": 2.5}})
    assert (spec.presence_penalty, spec.frequency_penalty, spec.repeat_penalty,
            spec.penalty_last_n) == (0.5, -0.5, 1.2, -1)
    assert spec.logit_bias == ((3, -100.0), (4, 2.5))


async def test_props_show_the_default_generation_settings(client, service):
    service.sampling_defaults = resolve_sampling_defaults({}, {"temperature": 0.3})
    body = await (await client.get("/props")).json()
    settings = body["default_generation_settings"]
    assert settings["params"]["temperature"] == 0.3 and settings["params"]["top_k"] == 40
    assert settings["sources"]["temperature"] == "settings"
    assert settings["sources"]["min_p"] == "llama.cpp"


async def test_chat_logprobs_in_openai_shape(client, service, text_assets):
    resp = await client.post(CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 2})
    body = await resp.json()
    content = body["choices"][0]["logprobs"]["content"]
    reply = service.reply_ids()[:-1]  # the end-of-sequence token makes no text
    assert [bytes(e["bytes"]) for e in content] == [
        text_assets.decode([t]).encode() for t in reply]
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    assert all(e["logprob"] == -0.25 and len(e["top_logprobs"]) == 2 for e in content)
    assert content[0]["top_logprobs"][1]["logprob"] == -1.25
    assert service.requests[-1].sampling.num_logprobs == 2


async def test_no_logprobs_unless_asked(client, service):
    body = await (await client.post(CHAT, json={"messages": USER})).json()
    assert body["choices"][0]["logprobs"] is None
    assert service.requests[-1].sampling.num_logprobs is None


async def test_completion_logprobs_in_the_legacy_shape(client, service):
    body = await (await client.post("/v1/completions", json={"prompt": "hi",
                                                              "logprobs": 1})).json()
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"] == [-0.25] * len(logprobs["tokens"])
    assert [len(t) for t in logprobs["top_logprobs"]] == [1] * len(logprobs["tokens"])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)


async def test_streamed_chat_logprobs_cover_every_token(client, service):
    resp = await client.post(CHAT, json={"messages": USER, "stream": True, "logprobs": True})
    chunks = [data for _, data in parse_sse(await resp.text()) if data != "[DONE]"]
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
               for e in ch["logprobs"]["content"]]
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
    assert "".join(e["token"] for e in entries) == text and entries


async def test_n_choices_each_with_its_index_seed_and_usage(client, service):
    body = await (await client.post(CHAT, json={"messages": USER, "n": 3, "seed": 10})).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [r.sampling.seed for r in service.requests] == [10, 11, 12]
    # No slot named: the engine picks, and one after another the same prompt finds the slot
    # whose cached prefix it shares, so the prompt's K/V is prefilled once.
    assert {r.slot for r in service.requests} == {None}
    num_reply = len(service.reply_ids())
    assert body["usage"]["completion_tokens"] == 3 * num_reply
    assert body["usage"]["prompt_tokens"] == len(service.requests[0].prompt_ids)


async def test_streamed_n_choices_are_tagged_with_their_index(client, service):
    resp = await client.post("/v1/completions", json={
        "prompt": "hi", "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [data for _, data in parse_sse(await resp.text()) if data != "[DONE]"]
    by_index: dict[int, str] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes.append(choice["index"])
    assert finishes == [0, 1] and by_index[0] == by_index[1] == service.reply_text
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(service.reply_ids())


async def test_choice_seeds_wrap_within_the_engine_range(client, service):
    resp = await client.post(CHAT, json={"messages": USER, "n": 2, "seed": 2**64 - 1})
    assert resp.status == 200
    assert [r.sampling.seed for r in service.requests] == [2**64 - 1, 0]


async def test_logprobs_stop_where_a_stop_string_cut_the_text(client, service):
    body = await (await client.post(CHAT, json={"messages": USER, "logprobs": True,
                                                "stop": "answer"})).json()
    content = body["choices"][0]["message"]["content"]
    tokens = [e["token"] for e in body["choices"][0]["logprobs"]["content"]]
    assert content == "Hello world! The "
    # Every token but the last lies inside the text; the last one reaches into it.
    assert "".join(tokens[:-1]) == content[:len("".join(tokens[:-1]))]
    assert len("".join(tokens[:-1])) < len(content) <= len("".join(tokens))
    assert "42" not in "".join(tokens)
