"""The embedding routes' request handling and shapes, over the fake service (the real engine's
vectors are checked in tests/service/test_embeddings_http.py)."""

from __future__ import annotations

import base64
import struct

import pytest

from strata.engine.protocol import Embeddings

from .fake_service import EMBEDDING_SIZE


async def test_openai_shape_and_base64(client, service):
    response = await client.post("/v1/embeddings", json={"input": ["Hello", "world"],
                                                         "model": "x"})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["object"] == "list" and body["model"] == service.model_id
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" and len(d["embedding"]) == EMBEDDING_SIZE
               for d in body["data"])
    num_tokens = sum(len(service.text.encode(t)) for t in ("Hello", "world"))
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    packed = await (await client.post("/embeddings", json={
        "input": ["Hello", "world"], "encoding_format": "base64"})).json()
    for plain, encoded in zip(body["data"], packed["data"], strict=True):
        raw = base64.b64decode(encoded["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert decoded == pytest.approx(plain["embedding"], abs=1e-7)
    assert service.calls[-1][2] == "last"  # a model that declares no pooling


async def test_token_inputs_are_sent_as_given(client, service):
    for body in ({"input": [5, 6, 7]}, {"input": [[5, 6, 7], [8]]}):
        response = await client.post("/v1/embeddings", json=body)
        assert response.status == 200, await response.text()
    assert service.calls[-2][1] == [[5, 6, 7]] and service.calls[-1][1] == [[5, 6, 7], [8]]


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", True]}, "input"),
    ({"input": {"content": "a"}}, "input"),
    ({"input": {"content": [{"type": "image_url"}]}}, "input"),
    ({"input": [[1, 99999]]}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "truncate": True}, "truncate"),
])
async def test_openai_refusals_name_the_field(client, service, body, param):
    response = await client.post("/v1/embeddings", json=body)
    assert response.status == 400
    assert (await response.json())["error"]["param"] == param
    assert not [c for c in service.calls if c[0] == "embed"]


async def test_an_input_longer_than_the_context_is_refused(client, service):
    service.context_tokens = 4
    response = await client.post("/v1/embeddings", json={"input": [1, 2, 3, 4, 5]})
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "context_length_exceeded"


async def test_ollama_routes(client, service):
    name = f"{service.model_id}:latest"
    body = await (await client.post("/api/embed", json={"model": name,
                                                         "input": "Hello"})).json()
    assert len(body["embeddings"]) == 1 and body["prompt_eval_count"] > 0
    legacy = await (await client.post("/api/embeddings", json={"model": name,
                                                                "prompt": "Hello"})).json()
    assert legacy["embedding"] == body["embeddings"][0]
    # No input only loads the model, as Ollama does.
    loaded = await (await client.post("/api/embed", json={"model": name})).json()
    assert loaded["embeddings"] == [] and ("control", "load", {}) in service.calls
    missing = await client.post("/api/embed", json={"model": "other", "input": "x"})
    assert missing.status == 404 and "not found" in (await missing.json())["error"]
    sampling = await client.post("/api/embed", json={"model": name, "input": "x",
                                                     "options": {"temperature": 0}})
    assert sampling.status == 400 and "num_ctx" in (await sampling.json())["error"]


async def test_ollama_keep_alive_zero_unloads_after(client, service):
    name = service.model_id
    response = await client.post("/api/embed", json={"model": name, "input": "Hello",
                                                     "keep_alive": 0})
    assert response.status == 200
    assert service.calls[-1] == ("control", "unload", {})


async def test_llama_cpp_embedding_shape(client):
    response = await client.post("/embedding", json={"content": ["Hello", "world"]})
    body = await response.json()
    assert [item["index"] for item in body] == [0, 1]
    assert all(len(item["embedding"]) == 1 for item in body)  # one pooled vector each
    refused = await client.post("/embedding", json={"content": "x", "embd_normalize": -1})
    assert refused.status == 400


async def test_the_fake_answers_what_the_engine_answers(service):
    answer = await service.embed([[1, 2], [3]], "last")
    assert isinstance(answer, Embeddings) and answer.num_tokens == 3
    assert all(isinstance(x, float) for vector in answer.vectors for x in vector)
