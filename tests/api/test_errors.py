"""Every 4xx the API gives for bad input, with the shape and message clients see."""

from __future__ import annotations

import pytest

from strata.engine.protocol import Error
from strata.engine.service.facade import ServiceError

USER = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 200}]
CHAT = "/v1/chat/completions"
MSG = "/v1/messages"

# (method, path, body: dict | bytes | None, status, message substring)
CASES = [
    ("POST", CHAT, b"{not json", 400, "not valid JSON"),
    ("POST", CHAT, b"\xff\xfe\x00", 400, "not valid JSON"),
    ("POST", CHAT, b"", 400, "body is empty"),
    ("POST", CHAT, [1, 2], 400, "must be a JSON object"),
    ("POST", CHAT, {}, 400, "'messages' must be a non-empty list"),
    ("POST", CHAT, {"messages": []}, 400, "'messages' must be a non-empty list"),
    ("POST", CHAT, {"messages": ["hi"]}, 400, "must be an object"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "unknown role"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400,
     "content must be a string"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "'image_url'"),
    ("POST", CHAT, {"messages": USER, "temperature": 3}, 400, "'temperature' is 3"),
    ("POST", CHAT, {"messages": USER, "temperature": -0.1}, 400, "'temperature' is -0.1"),
    ("POST", CHAT, {"messages": USER, "temperature": "hot"}, 400, "must be a number"),
    ("POST", CHAT, {"messages": USER, "top_p": 0}, 400, "'top_p' is 0"),
    ("POST", CHAT, {"messages": USER, "top_p": 1.5}, 400, "'top_p' is 1.5"),
    ("POST", CHAT, {"messages": USER, "top_k": -1}, 400, "at least 0"),
    ("POST", CHAT, {"messages": USER, "min_p": 2}, 400, "'min_p' is 2"),
    ("POST", CHAT, {"messages": USER, "max_tokens": 0}, 400, "'max_tokens' is 0"),
    ("POST", CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
     "'max_completion_tokens' is 0"),
    ("POST", CHAT, {"messages": USER, "max_tokens": True}, 400, "must be an integer"),
    ("POST", CHAT, {"messages": USER, "n": 9}, 400, "'n' is 9; it must be at most 8"),
    ("POST", CHAT, {"messages": USER, "n": 0}, 400, "'n' is 0"),
    ("POST", CHAT, {"messages": USER, "presence_penalty": 3}, 400, "'presence_penalty' is 3"),
    ("POST", CHAT, {"messages": USER, "frequency_penalty": "x"}, 400, "must be a number"),
    ("POST", CHAT, {"messages": USER, "repetition_penalty": 0}, 400,
     "'repetition_penalty' is 0"),
    ("POST", CHAT, {"messages": USER, "logit_bias": {"x": 1}}, 400, "is not a token id"),
    ("POST", CHAT, {"messages": USER, "logit_bias": {"5": 101}}, 400, "-100..100"),
    ("POST", CHAT, {"messages": USER, "logit_bias": {"99999999": 1}}, 400,
     "outside the vocabulary"),
    ("POST", CHAT, {"messages": USER, "logit_bias": [1]}, 400, "must be an object"),
    ("POST", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "needs 'logprobs': true"),
    ("POST", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400,
     "'top_logprobs' is 21"),
    ("POST", CHAT, {"messages": USER, "store": True}, 400, "'store': true is not supported"),
    ("POST", CHAT, {"messages": USER, "metadata": 5}, 400, "'metadata' must be an object"),
    ("POST", CHAT, {"messages": USER, "mirostat": 2}, 400,
     "'mirostat' is not supported by /v1/chat/completions"),
    ("POST", CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "'logprobs' is 6"),
    ("POST", "/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "'best_of' above 1"),
    ("POST", "/v1/completions", {"prompt": "hi", "n_predict": 5}, 400,
     "'n_predict' is not supported by /v1/completions"),
    ("POST", MSG, {"max_tokens": 5, "messages": USER, "typical_p": 0.5}, 400,
     "'typical_p' is not supported by /v1/messages"),
    ("POST", MSG, {"max_tokens": 5, "messages": USER, "presence_penalty": 1}, 400,
     "'presence_penalty' is not supported by /v1/messages"),
    ("POST", CHAT, {"messages": USER, "seed": "x"}, 400, "'seed' must be an integer"),
    ("POST", CHAT, {"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("POST", CHAT, {"messages": USER, "stop": 5}, 400, "must be a string or a list"),
    ("POST", CHAT, {"messages": USER, "stop": [""]}, 400, "empty string"),
    ("POST", CHAT, {"messages": USER, "stream": "yes"}, 400, "true or false"),
    ("POST", CHAT, {"messages": USER, "stream_options": 1}, 400, "must be an object"),
    ("POST", CHAT, {"messages": USER, "strata_cache_slot": 4}, 400,
     "'strata_cache_slot' is 4"),
    ("POST", CHAT, {"messages": USER, "id_slot": -2}, 400, "'id_slot' is -2"),
    ("POST", CHAT, {"messages": USER, "logprobs": "yes"}, 400, "true or false"),
    ("POST", CHAT, {"messages": LONG}, 400, "the context is 512 tokens"),
    ("POST", CHAT, {"messages": USER, "max_tokens": 600}, 400, "the context is 512 tokens"),
    ("POST", "/v1/completions", {}, 400, "'prompt' must be"),
    ("POST", "/v1/completions", {"prompt": 5}, 400, "'prompt' must be"),
    ("POST", "/v1/completions", {"prompt": ["a", "b"]}, 400, "batches"),
    ("POST", "/v1/completions", {"prompt": [1, 10**9]}, 400, "outside 0.."),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 512}, 400, "prompt is "),
    ("POST", MSG, {"messages": USER}, 400, "'max_tokens' is required"),
    ("POST", MSG, {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400,
     "unknown role"),
    ("POST", MSG, {"max_tokens": 5, "messages": USER, "temperature": 1.5}, 400,
     "'temperature' is 1.5"),
    ("POST", MSG, {"max_tokens": 5, "messages": USER, "system": 5}, 400,
     "'system' content must be"),
    ("POST", MSG, {"max_tokens": 5, "messages": USER, "stop_sequences": [""]}, 400,
     "empty string"),
    ("POST", MSG, b"[", 400, "not valid JSON"),
    ("POST", MSG + "/count_tokens", {"messages": []}, 400, "non-empty list"),
    ("POST", "/tokenize", {}, 400, "'content' must be a string"),
    ("POST", "/detokenize", {"tokens": ["a"]}, 400, "list of integer token ids"),
    ("POST", "/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
    ("POST", "/slots/9?action=save", {"filename": "a"}, 400, "slot '9' does not exist"),
    ("POST", "/slots/x?action=save", {"filename": "a"}, 400, "does not exist"),
    ("POST", "/slots/0?action=fly", {"filename": "a"}, 400, "use ?action=save"),
    ("POST", "/slots/0", {"filename": "a"}, 400, "use ?action=save"),
    ("POST", "/slots/0?action=save", {}, 400, "'filename' must be a non-empty string"),
    ("POST", "/slots/0?action=save", {"filename": "../x"}, 400, "plain file name"),
    ("POST", "/slots/0?action=restore", {"filename": "/etc/passwd"}, 400, "plain file name"),
    ("POST", "/slots/0?action=save", {"filename": "a\\b"}, 400, "plain file name"),
    ("POST", "/slots/0?action=save", {"filename": "a\x00b"}, 400, "plain file name"),
    ("POST", "/slots/0?action=save", {"filename": "C:x"}, 400, "plain file name"),
    ("POST", "/slots/0?action=save", {"filename": ".."}, 400, "plain file name"),
    ("POST", "/load", b"[", 400, "not valid JSON"),
    ("GET", "/nope", None, 404, "no route GET /nope"),
    ("POST", MSG + "/nope", {}, 404, "no route"),
    ("GET", CHAT, None, 405, "method GET is not allowed"),
    ("DELETE", "/health", None, 405, "not allowed"),
]


def _assert_error_shape(body: dict, path: str, status: int) -> str:
    if path.startswith(MSG):
        assert body["type"] == "error"
        assert isinstance(body["error"]["type"], str)
        return body["error"]["message"]
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["type"] != "server_error" or status >= 500
    return body["error"]["message"]


@pytest.mark.parametrize("method,path,body,status,needle", CASES,
                         ids=[f"{c[0]} {c[1]} {c[4]}" for c in CASES])
async def test_bad_requests(client, service, method, path, body, status, needle):
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = await client.request(method, path, **({} if body is None else kwargs))
    assert resp.status == status
    assert resp.content_type == "application/json"
    message = _assert_error_shape(await resp.json(), path, status)
    assert needle in message
    assert "Traceback" not in message
    assert not [c for c in service.calls if c[0] == "generate"]


async def test_invalid_slot_on_stream_fails_before_sse_headers(client, service):
    resp = await client.post(CHAT, json={"messages": USER, "stream": True,
                                         "strata_cache_slot": 7})
    assert resp.status == 400 and resp.content_type == "application/json"
    resp = await client.post(MSG, json={"messages": USER, "stream": True, "max_tokens": 3,
                                        "strata_cache_slot": "one"})
    assert resp.status == 400 and (await resp.json())["type"] == "error"
    assert service.calls == []


async def test_service_error_keeps_its_status_and_retry_after(client, service):
    service.start_error = ServiceError("insufficient_vram", "need 2048 MiB more VRAM",
                                       retry_after_s=2.5)
    resp = await client.post(CHAT, json={"messages": USER, "stream": True})
    assert resp.status == 503 and resp.headers["Retry-After"] == "3"
    body = await resp.json()
    assert body["error"]["code"] == "insufficient_vram"
    assert "2048 MiB" in body["error"]["message"]
    resp = await client.post(MSG, json={"messages": USER, "max_tokens": 3})
    assert resp.status == 503
    assert (await resp.json())["error"]["type"] == "overloaded_error"


async def test_error_event_before_any_token_is_a_plain_http_error(client, service):
    service.first_error = Error("busy", "a request is running; retry when it ends")
    resp = await client.post(CHAT, json={"messages": USER, "stream": True})
    assert resp.status == 409 and resp.content_type == "application/json"
    assert "request is running" in (await resp.json())["error"]["message"]


async def test_control_conflict_and_unexpected_exception(client, service):
    service.control_error = ServiceError("busy", "a request is running")
    resp = await client.post("/unload")
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "busy"
    service.control_error = RuntimeError("secret internal detail")
    resp = await client.post("/sleep")
    assert resp.status == 500
    body = await resp.json()
    assert body["error"]["type"] == "server_error"
    assert "secret" not in body["error"]["message"]
