"""llama.cpp's /infill: the model's FIM layout of input_extra, input_prefix, input_suffix and
prompt, answered in /completion's shape; a model without FIM tokens is a 400 saying so."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer

from strata.engine.api import create_app

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"]


def with_tokens(service, tokens: list[str]) -> None:
    tokenizer = Tokenizer.from_str(service.text.tokenizer.to_str())
    tokenizer.add_special_tokens(tokens)
    service.text = dataclasses.replace(service.text, tokenizer=tokenizer,
                                       vocab_size=tokenizer.get_vocab_size())


@pytest.fixture
async def fim_client(aiohttp_client, service):
    with_tokens(service, FIM)
    return await aiohttp_client(create_app(service))


async def test_the_prompt_is_the_models_fim_layout(fim_client, service):
    response = await fim_client.post("/infill", json={
        "input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))",
        "prompt": "a", "input_extra": [{"filename": "util.py", "text": "X = 1"}],
        "n_predict": 5, "temperature": 0})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["tokens_predicted"] == 5 and body["stop_type"] == "limit"
    assert body["content"] and body["tokens_evaluated"] == len(service.requests[-1].prompt_ids)
    text = service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)
    assert text == ("<|file_sep|>util.py\nX = 1<|file_sep|><|fim_prefix|>def add(a, b):\n"
                    "    return <|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>a")
    assert service.requests[-1].sampling.max_tokens == 5


async def test_streamed_like_completion(fim_client, service):
    response = await fim_client.post("/infill", json={"input_prefix": "x = ",
                                                      "input_suffix": "", "stream": True})
    lines = [line for line in (await response.text()).splitlines() if line.startswith("data")]
    assert '"stop":true' in lines[-1] and len(lines) > 2


@pytest.mark.parametrize(("body", "words"), [
    ({"input_prefix": 3}, "'input_prefix' must be a string"),
    ({"input_prefix": "x", "input_extra": "a.py"}, "input_extra"),
    ({"input_prefix": "x", "suffix": "y"}, "'suffix' is not supported by /infill"),
])
async def test_bad_requests(fim_client, body, words):
    response = await fim_client.post("/infill", json=body)
    assert response.status == 400 and words in (await response.json())["error"]["message"]


async def test_a_model_without_fim_tokens_is_refused(client, service):
    response = await client.post("/infill", json={"input_prefix": "x", "input_suffix": "y"})
    assert response.status == 400
    assert "no FIM tokens" in (await response.json())["error"]["message"]
    assert not service.requests


async def test_input_extra_needs_a_file_separator(aiohttp_client, service):
    with_tokens(service, FIM[:3])
    client = await aiohttp_client(create_app(service))
    response = await client.post("/infill", json={
        "input_prefix": "x", "input_extra": [{"filename": "a", "text": "b"}]})
    assert response.status == 400 and "file separator" in (await response.json())["error"][
        "message"]
    ok = await client.post("/infill", json={"input_prefix": "x", "input_suffix": "y"})
    assert ok.status == 200
