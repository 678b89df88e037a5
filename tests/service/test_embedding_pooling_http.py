"""llama-server's --pooling none: `serve --pooling none` with the real engine process on a tiny
llama (CPU) answers /embedding and /embeddings with a vector per token, not normalized, and
refuses the routes whose answer has one vector per input (OpenAI's, Ollama's)."""

from __future__ import annotations

import math

import aiohttp
import openai
import pytest
import pytest_asyncio
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.serving import serving
from tests.snapshots.helpers import VOCAB, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

TEXTS = ["w5 w9 w17", "w33 w40"]  # word-level tokenizer: 3 and 2 tokens


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def servers(tmp_path_factory):
    """(url with --pooling none, url with the model's pooling) over the same tiny model."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)
    urls = []
    for pooling in ("none", "model"):
        settings = ServeSettings(model=str(model_dir), port=0, device="cpu", context_tokens=64,
                                 embedding_pooling=pooling,
                                 snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
        urls.append(serving(settings, Service(settings)))
    async with urls[0] as none_url, urls[1] as model_url:
        yield none_url, model_url


async def _post(url: str, body: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
async def test_pooling_none_answers_a_vector_per_token(servers, path):
    none_url, model_url = servers
    status, answer = await _post(none_url + path, {"input": TEXTS})
    assert status == 200, answer
    assert [a["index"] for a in answer] == [0, 1]
    assert [len(a["embedding"]) for a in answer] == [3, 2]
    for item in answer:
        for row in item["embedding"]:
            assert abs(math.fsum(x * x for x in row) - 1) > 1e-3  # not normalized
    # The last token's row is the last-token pooling's vector before normalization.
    status, pooled = await _post(model_url + "/embedding", {"input": TEXTS[0]})
    assert status == 200, pooled
    last = answer[0]["embedding"][-1]
    norm = math.sqrt(math.fsum(x * x for x in last))
    assert [x / norm for x in last] == pytest.approx(pooled[0]["embedding"][0], abs=1e-5)


async def test_routes_of_one_vector_per_input_refuse_pooling_none(servers):
    none_url, _ = servers
    async with aiohttp.ClientSession() as session, session.get(none_url + "/api/tags") as resp:
        model = (await resp.json())["models"][0]["name"]
    for path, body in (("/v1/embeddings", {"input": TEXTS}),
                       ("/embeddings", {"input": TEXTS, "model": "x"}),  # OpenAI's body
                       ("/api/embed", {"input": TEXTS, "model": model})):
        status, answer = await _post(none_url + path, body)
        assert status == 400, (path, answer)
        assert isinstance(answer, dict)
        error = answer["error"]
        assert "--pooling none" in (error["message"] if isinstance(error, dict) else error)
    client = openai.AsyncOpenAI(base_url=f"{none_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="pooling none"):
        await client.embeddings.create(model="x", input=TEXTS)


async def test_embeddings_without_v1_is_llama_servers_route_unless_the_body_is_openais(servers):
    _, model_url = servers
    status, native = await _post(model_url + "/embeddings", {"input": TEXTS[0]})
    assert status == 200 and isinstance(native, list) and len(native[0]["embedding"]) == 1
    status, oai = await _post(model_url + "/embeddings", {"input": TEXTS[0], "model": "x"})
    assert status == 200 and oai["object"] == "list"
    assert oai["data"][0]["embedding"] == pytest.approx(native[0]["embedding"][0], abs=1e-6)
