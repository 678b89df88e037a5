"""Embeddings end to end: the real openai and ollama clients against `serve` with the real engine
process on a tiny llama (CPU); vectors checked against transformers' own hidden states."""

from __future__ import annotations

import math

import aiohttp
import ollama
import openai
import pytest
import pytest_asyncio
import torch
import torch.nn.functional as F
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.serving import serving
from tests.snapshots.helpers import VOCAB, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

HIDDEN_SIZE = 64  # save_tiny_llama's
TEXTS = ["w5 w9 w17 w33", "w5 w9 w17 w33", "w40 w41 w42"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tmp_path_factory):
    """serve() over a Service with the real engine; yields (base url, service, model dir)."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)  # word-level: "w5" is token 5
    settings = ServeSettings(model=str(model_dir), port=0, device="cpu", context_tokens=256,
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    service = Service(settings)
    async with serving(settings, service) as base_url:
        yield base_url, service, model_dir


@pytest.fixture(scope="module")
def reference(server):
    """text -> transformers' last-token final hidden state, L2-normalized."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(server[2], dtype=torch.float32)

    def vector(text: str) -> list[float]:
        ids = [int(word[1:]) for word in text.split()]
        with torch.no_grad():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        return F.normalize(hidden, dim=0).tolist()
    return vector


def norm(vector) -> float:
    return math.sqrt(sum(x * x for x in vector))


def close(a, b, tolerance: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < tolerance


async def test_openai_sdk_embeddings_are_the_models_hidden_states(server, reference):
    base, service, _ = server
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    # The SDK asks for base64 unless told otherwise, and decodes it: both encodings checked.
    for encoding in (openai.NOT_GIVEN, "float"):
        answer = await client.embeddings.create(model=service.model_id, input=TEXTS,
                                                encoding_format=encoding)
        vectors = [item.embedding for item in answer.data]
        assert [item.index for item in answer.data] == [0, 1, 2]
        assert all(len(v) == HIDDEN_SIZE and abs(norm(v) - 1) < 1e-5 for v in vectors)
        assert vectors[0] == vectors[1] and not close(vectors[0], vectors[2], 1e-2)
        for text, vector in zip(TEXTS, vectors, strict=True):
            assert close(vector, reference(text)), text
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == 11
    single = await client.embeddings.create(model=service.model_id, input=[5, 9, 17, 33])
    assert close(single.data[0].embedding, vectors[0], 1e-6)


async def test_openai_refuses_dimensions_and_overlong_input(server):
    base, service, _ = server
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        await client.embeddings.create(model=service.model_id, input="w5", dimensions=32)
    answer = await client.embeddings.create(model=service.model_id, input="w5",
                                            dimensions=HIDDEN_SIZE)
    assert len(answer.data[0].embedding) == HIDDEN_SIZE
    with pytest.raises(openai.BadRequestError, match="the context is 256"):
        await client.embeddings.create(model=service.model_id, input=" ".join(["w7"] * 300))


async def test_ollama_client_embed_and_embeddings(server, reference):
    base, service, _ = server
    client = ollama.AsyncClient(host=base)
    answer = await client.embed(model=f"{service.model_id}:latest", input=TEXTS)
    assert len(answer.embeddings) == 3 and answer.prompt_eval_count == 11
    for text, vector in zip(TEXTS, answer.embeddings, strict=True):
        assert close(vector, reference(text))
    legacy = await client.embeddings(model=service.model_id, prompt=TEXTS[2])
    assert close(legacy.embedding, answer.embeddings[2], 1e-6)
    long_text = " ".join(["w7"] * 300)
    cut = await client.embed(model=service.model_id, input=long_text)  # truncate: default on
    assert cut.prompt_eval_count == 256
    with pytest.raises(ollama.ResponseError, match="the context is 256") as refused:
        await client.embed(model=service.model_id, input=long_text, truncate=False)
    assert refused.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="dimensions"):
        await client.embed(model=service.model_id, input="w5", dimensions=8)


async def test_llama_cpp_embedding_route(server, reference):
    base, _, _ = server
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/embedding", json={"content": TEXTS[2]}) as response:
            assert response.status == 200, await response.text()
            (item,) = await response.json()
        assert item["index"] == 0 and close(item["embedding"][0], reference(TEXTS[2]))
        async with session.post(f"{base}/embedding",
                                json={"content": TEXTS[2], "embd_normalize": 1}) as response:
            (taxicab,) = await response.json()
        assert abs(sum(abs(x) for x in taxicab["embedding"][0]) - 1) < 1e-5
        async with session.post(f"{base}/embedding", json={"content": "w5", "pooling": "mean"}
                                ) as response:
            assert response.status == 400 and "pooling" in await response.text()


async def test_embedding_brings_the_model_back_from_sleep_and_unload(server, reference):
    base, service, _ = server
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none")
    for level in ("sleep", "unload"):
        await service.control(level)
        assert service.status()["state"] != "loaded"
        answer = await client.embeddings.create(model=service.model_id, input=TEXTS[0])
        assert close(answer.data[0].embedding, reference(TEXTS[0]))
        assert service.status()["state"] == "loaded"
