"""llama.cpp's POST /completion: n_predict, its sampling names, n_probs, and its answer shape."""

from __future__ import annotations

import pytest

from .conftest import parse_sse


async def test_n_predict_and_llama_cpp_sampling_names_reach_the_engine(client, service):
    resp = await client.post("/completion", json={
        "prompt": "hi", "n_predict": 3, "temperature": 0.2, "top_k": 5, "min_p": 0.1,
        "repeat_penalty": 1.3, "repeat_last_n": 32, "presence_penalty": 0.5, "seed": 4,
        "id_slot": 2, "logit_bias": [[3, -100], [5, False], [6, 1.5]], "cache_prompt": True})
    body = await resp.json()
    assert resp.status == 200, body
    spec = service.requests[-1].sampling
    assert spec.max_tokens == 3 and body["tokens_predicted"] == 3
    assert (spec.temperature, spec.top_k, spec.min_p, spec.repeat_penalty,
            spec.penalty_last_n, spec.presence_penalty, spec.seed) == \
        (0.2, 5, 0.1, 1.3, 32, 0.5, 4)
    assert spec.logit_bias == ((3, -100.0), (5, -100.0), (6, 1.5))
    assert service.requests[-1].slot == 2
    assert body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_evaluated"] == len(service.requests[-1].prompt_ids)
    assert "completion_probabilities" not in body


async def test_defaults_fill_what_the_request_leaves_out(client, service):
    body = await (await client.post("/completion", json={"prompt": "hi"})).json()
    spec = service.requests[-1].sampling
    assert (spec.temperature, spec.top_k, spec.top_p, spec.min_p, spec.seed) == \
        (0.8, 40, 0.95, 0.05, None)
    assert body["content"] == service.reply_text and body["stop_type"] == "eos"


async def test_n_probs_gives_completion_probabilities(client, service, text_assets):
    body = await (await client.post("/completion", json={"prompt": "hi", "n_probs": 2})).json()
    probs = body["completion_probabilities"]
    assert "".join(p["token"] for p in probs) == body["content"]
    assert all(len(p["top_logprobs"]) == 2 and p["logprob"] == -0.25 for p in probs)
    assert probs[0]["id"] == service.reply_ids()[0]
    assert bytes(probs[0]["bytes"]) == text_assets.decode([probs[0]["id"]]).encode()


async def test_streamed_completion_ends_with_the_final_object(client, service):
    resp = await client.post("/completion", json={"prompt": "hi", "stream": True, "n_probs": 1})
    events = [data for _, data in parse_sse(await resp.text())]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == service.reply_text
    assert sum(len(e["completion_probabilities"]) for e in events) == \
        len(service.reply_ids()) - 1  # the end-of-sequence token makes no text


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "hi", "n_predict": 0}, "'n_predict' is 0"),
    ({"prompt": "hi", "n_predict": -2}, "at least -1"),
    ({"prompt": "hi", "mirostat": 2}, "'mirostat' is not supported by /completion"),
    ({"prompt": "hi", "cache_prompt": 1}, "'cache_prompt' must be"),
    ({"prompt": {"prompt_string": "hi", "multimodal_data": ["x"]}}, "'multimodal_data'"),
    ({"prompt": ["a", "b"], "stream": True}, "streaming several prompts"),
    ({"prompt": "hi", "response_fields": "content"}, "'response_fields' must be"),
    ({"prompt": "hi", "n_probs": 21}, "'n_probs' is 21"),
    ({"prompt": "hi", "logit_bias": [[1]]}, "[token id, bias]"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": 5}, "'prompt' must be"),
    ({"prompt": "hi", "id_slot": 4}, "'id_slot' is 4"),
])
async def test_bad_completion_requests(client, service, body, needle):
    resp = await client.post("/completion", json=body)
    assert resp.status == 400
    assert needle in (await resp.json())["error"]["message"]
    assert not service.requests
