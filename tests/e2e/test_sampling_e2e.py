"""Sampling through the real server, engine and SDKs: the documented examples without sampling
fields answer sensibly (issue 17 item 16), penalties and logit_bias change what the engine
picks (item 17), and logprobs and n come back in OpenAI's shapes (issue 20 item 6)."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    yield client
    client.close()


def test_the_documented_examples_answer_without_sampling_fields(
        oai: openai.OpenAI, server: ServerProcess) -> None:
    """As docs/getting-started.md and the README call it: no temperature, no top_p."""
    for seed in (1, 2, 3):
        reply = oai.chat.completions.create(model="default", messages=QUESTION,
                                            max_tokens=MAX_TOKENS, seed=seed)
        assert "Paris" in reply.choices[0].message.content, (seed, reply.choices[0])
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model="default", max_tokens=MAX_TOKENS, messages=QUESTION)
    assert "Paris" in message.content[0].text, message.content
    request = urllib.request.Request(  # the curl example: a bare JSON body
        f"{server.base_url}/v1/chat/completions", method="POST",
        data=json.dumps({"messages": QUESTION, "max_tokens": MAX_TOKENS}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.load(response)
    assert "Paris" in body["choices"][0]["message"]["content"], body
    props = server.get_json("/props")["default_generation_settings"]
    assert props["params"]["temperature"] == 0.0
    assert props["sources"]["temperature"] == "strata (embedded default model)"
    assert props["params"]["top_k"] == 40 and props["sources"]["top_k"] == "llama.cpp"


def test_logprobs_and_top_logprobs(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                        max_tokens=8, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == choice.message.content
    # One entry per token of text: the end-of-sequence token that stopped it has none.
    num_eos = 1 if choice.finish_reason == "stop" else 0
    assert len(content) == reply.usage.completion_tokens - num_eos
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert bytes(entry.bytes).decode() == entry.token
        # Greedy picks the most likely token, so it heads the alternatives.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        values = [alt.logprob for alt in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    stream = oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                         max_tokens=8, logprobs=True, stream=True)
    streamed = [entry.token for chunk in stream for c in chunk.choices if c.logprobs
                for entry in c.logprobs.content]
    assert streamed == [entry.token for entry in content]


def test_completions_logprobs(oai: openai.OpenAI) -> None:
    done = oai.completions.create(model="default", prompt="The capital of France is",
                                  temperature=0, max_tokens=4, logprobs=2)
    logprobs = done.choices[0].logprobs
    assert "".join(logprobs.tokens) == done.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_n_choices_share_the_prompt(oai: openai.OpenAI, server: ServerProcess) -> None:
    fresh = [{"role": "user", "content": "Name a colour of the French flag."}]
    before = server.status()["counters"]["cached_tokens_total"]
    # Slot 3 has never held this prompt: the first choice prefills it, the second reuses it.
    counted = oai.chat.completions.create(model="default", messages=fresh, n=2, max_tokens=4,
                                          extra_body={"strata_cache_slot": 3})
    assert [c.index for c in counted.choices] == [0, 1]
    cached = server.status()["counters"]["cached_tokens_total"] - before
    assert cached == counted.usage.prompt_tokens - 1
    reply = oai.chat.completions.create(model="default", messages=QUESTION, n=2, seed=5,
                                        temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    single = oai.chat.completions.create(model="default", messages=QUESTION, seed=5,
                                         temperature=1.0, max_tokens=MAX_TOKENS)
    assert reply.choices[0].message.content == single.choices[0].message.content
    again = oai.chat.completions.create(model="default", messages=QUESTION, seed=6,
                                        temperature=1.0, max_tokens=MAX_TOKENS)
    assert reply.choices[1].message.content == again.choices[0].message.content  # seed + 1
    assert reply.usage.completion_tokens == sum(
        r.usage.completion_tokens for r in (single, again))


def test_penalties_and_logit_bias_change_the_answer(oai: openai.OpenAI) -> None:
    def greedy(**extra) -> str:
        return oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                           max_tokens=MAX_TOKENS, **extra).choices[0].message.content

    plain = greedy()
    tokens = oai.chat.completions.create(model="default", messages=QUESTION, temperature=0,
                                         max_tokens=1, logprobs=True).choices[0]
    first_token = tokens.logprobs.content[0].token
    banned = greedy(logit_bias={_token_id(oai, first_token): -100})
    assert not banned.startswith(first_token), (plain, banned)
    assert greedy(frequency_penalty=2.0, presence_penalty=2.0) != plain


def _token_id(oai: openai.OpenAI, token: str) -> str:
    base = str(oai.base_url).removesuffix("/v1/").removesuffix("/v1")
    request = urllib.request.Request(
        f"{base}/tokenize", method="POST",
        data=json.dumps({"content": token}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        (token_id,) = json.load(response)["tokens"]
    return str(token_id)


def test_llama_cpp_completion_with_n_predict_and_n_probs(server: ServerProcess) -> None:
    request = urllib.request.Request(
        f"{server.base_url}/completion", method="POST",
        data=json.dumps({"prompt": "The capital of France is", "n_predict": 3,
                         "temperature": 0, "n_probs": 2}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.load(response)
    assert "Paris" in body["content"] and body["tokens_predicted"] == 3
    probs = body["completion_probabilities"]
    assert "".join(p["token"] for p in probs) == body["content"]
    assert all(p["top_logprobs"][0]["id"] == p["id"] for p in probs)  # greedy: the top one
