"""llama.cpp's native shapes on its native routes, against `serve` with the real engine process
on a tiny llama (CPU): /completion's timings, tokens, generation_settings and prompt forms,
cache_prompt: false, /completions told apart from OpenAI's, /responses, embedding inputs."""

from __future__ import annotations

import json

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

PROMPT = "w5 w9 w17 w33 w40 w41 w42 w43"
GREEDY = {"temperature": 0, "n_predict": 4}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)  # word-level: "w5" is token 5
    settings = ServeSettings(model=str(model_dir), port=0, device="cpu", context_tokens=256,
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    async with serving(settings, Service(settings)) as url:
        yield url


async def _post(url: str, body: dict) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _stream(url: str, body: dict) -> list[dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


async def test_completion_answers_timings_tokens_and_settings(base_url):
    status, body = await _post(f"{base_url}/completion",
                               {"prompt": PROMPT, "return_tokens": True, "seed": 7, **GREEDY})
    assert status == 200, body
    assert isinstance(body, dict)
    timings = body["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == 8 and timings["predicted_n"] == 4
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0
    # the first token comes with the prompt: the rate is over the 3 decode steps after it
    assert timings["predicted_per_second"] == pytest.approx(3000 / timings["predicted_ms"])
    assert len(body["tokens"]) == 4 and all(isinstance(t, int) for t in body["tokens"])
    settings = body["generation_settings"]
    assert (settings["n_predict"], settings["seed"], settings["temperature"]) == (4, 7, 0)
    assert body["prompt"] == PROMPT and isinstance(body["has_new_line"], bool)
    assert body["truncated"] is False


async def test_streamed_completion_sends_token_ids_and_final_timings(base_url):
    events = await _stream(f"{base_url}/completion", {"prompt": PROMPT, "stream": True,
                                                      **GREEDY})
    partial, final = events[:-1], events[-1]
    assert partial and all(e["stop"] is False and e["tokens"] for e in partial)
    assert sum(len(e["tokens"]) for e in partial) == 4
    assert final["stop"] is True and final["timings"]["predicted_n"] == 4


async def test_cache_prompt_false_evaluates_the_whole_prompt(base_url):
    prompt = "w7 w8 w9 w10 w11 w12 w13 w14 w15 w16"
    await _post(f"{base_url}/completion", {"prompt": prompt, "id_slot": 1, **GREEDY})
    _, cached = await _post(f"{base_url}/completion", {"prompt": prompt, "id_slot": 1,
                                                       **GREEDY})
    _, uncached = await _post(f"{base_url}/completion", {"prompt": prompt, "id_slot": 1,
                                                         "cache_prompt": False, **GREEDY})
    assert isinstance(cached, dict) and isinstance(uncached, dict)
    assert cached["timings"]["cache_n"] == 9  # all but the last prompt token
    assert uncached["timings"]["cache_n"] == 0 and uncached["timings"]["prompt_n"] == 10
    assert uncached["content"] == cached["content"]  # greedy: the cache changes nothing


async def test_prompt_forms_and_batches(base_url):
    url = f"{base_url}/completion"
    ids = [5, 9, 17, 33]
    _, one = await _post(url, {"prompt": ids, **GREEDY})
    _, mixed = await _post(url, {"prompt": [5, 9, "w17 w33"], **GREEDY})
    _, as_object = await _post(url, {"prompt": {"prompt_string": "w5 w9 w17 w33"}, **GREEDY})
    status, batch = await _post(url, {"prompt": [ids, "w5 w9 w17 w33"], **GREEDY})
    assert isinstance(one, dict) and isinstance(mixed, dict) and isinstance(as_object, dict)
    assert one["content"] == mixed["content"] == as_object["content"]
    assert status == 200 and isinstance(batch, list)
    assert [b["index"] for b in batch] == [0, 1]
    assert batch[0]["content"] == batch[1]["content"] == one["content"]
    _, fields = await _post(url, {"prompt": ids, "response_fields": [
        "content", "generation_settings/n_predict"], **GREEDY})
    assert fields == {"content": one["content"], "generation_settings/n_predict": 4}


async def test_completions_without_v1_is_llama_cpp_unless_the_body_is_openai(base_url):
    url = f"{base_url}/completions"
    _, native = await _post(url, {"prompt": PROMPT, **GREEDY})
    assert isinstance(native, dict) and "content" in native and "timings" in native
    _, bare = await _post(url, {"prompt": PROMPT, "temperature": 0})
    assert isinstance(bare, dict) and "content" in bare
    _, openai_shape = await _post(url, {"model": "m", "prompt": PROMPT, "max_tokens": 4})
    assert isinstance(openai_shape, dict) and openai_shape["object"] == "text_completion"


async def test_responses_without_v1(base_url):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
    response = await client.responses.create(model="tiny", input="w5 w9",
                                             max_output_tokens=4)
    assert response.id.startswith("resp_") and response.usage.output_tokens > 0
    stored = await client.responses.retrieve(response.id)
    assert stored.id == response.id


async def test_embedding_input_forms(base_url):
    url = f"{base_url}/v1/embeddings"
    inputs = ["w5 w9 w17", {"prompt_string": "w5 w9 w17"},
              {"content": [{"type": "text", "text": "w5 w9"}, {"type": "text", "text": " w17"}]},
              [5, "w9 w17"], [5, 9, 17]]
    status, body = await _post(url, {"input": inputs})
    assert status == 200, body
    assert isinstance(body, dict)
    vectors = [d["embedding"] for d in body["data"]]
    assert len(vectors) == 5 and all(v == vectors[0] for v in vectors)
    status, body = await _post(url, {"input": [5, "w9 w17"]})  # one mixed prompt
    assert status == 200 and isinstance(body, dict) and body["data"][0]["embedding"] == vectors[0]
    for bad in ({"content": "w5"}, {"content": [{"type": "image_url"}]}, []):
        status, body = await _post(url, {"input": bad})
        assert status == 400 and isinstance(body, dict) and body["error"]["param"] == "input"


async def test_ignore_eos_bans_the_end_of_sequence_tokens(base_url):
    status, body = await _post(f"{base_url}/completion", {"prompt": PROMPT, "ignore_eos": True,
                                                          "return_tokens": True, **GREEDY})
    assert status == 200, body
    assert isinstance(body, dict) and body["tokens_predicted"] == 4
    banned = body["generation_settings"]["logit_bias"]
    assert banned and all(entry["bias"] is None for entry in banned)  # -inf, as llama.cpp
    assert not {entry["token"] for entry in banned} & set(body["tokens"])


async def test_logit_bias_keys_that_are_text_bias_their_tokens(base_url):
    url = f"{base_url}/completion"
    _, plain = await _post(url, {"prompt": PROMPT, "return_tokens": True, **GREEDY})
    assert isinstance(plain, dict)
    first = plain["tokens"][0]
    for bias in ([[f"w{first}", False]], {f"w{first}": -100}):
        status, biased = await _post(url, {"prompt": PROMPT, "return_tokens": True,
                                           "logit_bias": bias, **GREEDY})
        assert status == 200, biased
        assert isinstance(biased, dict) and first not in biased["tokens"]
