"""What llama.cpp's own server tests expect of llama-server, against `serve` with the real
engine process on a tiny llama (CPU): its /metrics names and header, its context-size error
type, its server-wide seed and n-predict (--seed, --max-tokens), its token-counting routes."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.serving import serving
from tests.snapshots.helpers import VOCAB, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

PROMPT = "w5 w9 w17 w33 w40 w41 w42 w43"
CONTEXT_TOKENS = 64
SERVER_SEED, SERVER_MAX_TOKENS = 42, 6


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def base_url(tmp_path_factory):
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)  # word-level: "w5" is token 5
    settings = ServeSettings(model=str(model_dir), port=0, device="cpu",
                             context_tokens=CONTEXT_TOKENS, slots=1, seed=SERVER_SEED,
                             max_tokens=SERVER_MAX_TOKENS,
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    async with serving(settings, Service(settings)) as url:
        yield url


async def _post(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _metrics(base_url: str) -> tuple[dict[str, float], dict[str, str], Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/metrics") as resp:
        assert resp.status == 200
        text, headers = await resp.text(), resp.headers
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE llamacpp:"):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.split(" ", 1)
            values[name] = float(value)
    return values, types, headers


async def test_llama_cpp_metric_names_count_what_the_answers_report(base_url):
    before, _, _ = await _metrics(base_url)
    evaluated = cached = predicted = 0
    for n_predict in (1, 4, 4):
        status, body = await _post(f"{base_url}/completion", {
            "prompt": PROMPT, "n_predict": n_predict, "temperature": 0})
        assert status == 200, body
        evaluated += body["timings"]["prompt_n"]
        cached += body["timings"]["cache_n"]
        predicted += body["timings"]["predicted_n"]
    assert cached > 0  # the same prompt again on the one slot
    values, types, headers = await _metrics(base_url)
    assert 0 < int(headers["Process-Start-Time-Unix"]) <= time.time()
    delta = {name: values[name] - before.get(name, 0.0) for name in values}
    assert delta["llamacpp:prompt_tokens_total"] == evaluated  # cached tokens apart
    assert delta["llamacpp:prompt_tokens_cached_total"] == cached
    assert delta["llamacpp:tokens_predicted_total"] == predicted
    assert delta["llamacpp:prompt_seconds_total"] > 0
    assert values["llamacpp:n_tokens_max"] >= 8 + 4
    assert values["llamacpp:requests_processing"] == 0
    # The engine's forward calls: a prefill each (8 tokens, then 1 past the cached prefix)
    # and a decode step per token after the first (0 + 3 + 3); one sequence in each.
    assert delta["llamacpp:n_decode_total"] == 3 + 6
    assert values["llamacpp:n_busy_slots_per_decode"] == 1.0
    assert types["llamacpp:prompt_tokens_total"] == "counter"
    assert types["llamacpp:predicted_tokens_seconds"] == "gauge"
    # The throughput gauges cover the time since the previous scrape, as llama-server's do.
    assert values["llamacpp:predicted_tokens_seconds"] > 0
    again, _, _ = await _metrics(base_url)
    assert again["llamacpp:predicted_tokens_seconds"] == 0
    assert again["llamacpp:tokens_predicted_total"] == values["llamacpp:tokens_predicted_total"]
    # Embeddings evaluate prompts too (llama-server counts them): one forward per input here.
    status, _ = await _post(f"{base_url}/v1/embeddings", {"input": ["w5 w6", "w7"]})
    assert status == 200
    after, _, _ = await _metrics(base_url)
    assert after["llamacpp:prompt_tokens_total"] - again["llamacpp:prompt_tokens_total"] == 3
    assert after["llamacpp:n_decode_total"] - again["llamacpp:n_decode_total"] == 2
    assert after["llamacpp:tokens_predicted_total"] == again["llamacpp:tokens_predicted_total"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_past_the_context_is_llama_servers_error(base_url, stream):
    long_prompt = " ".join(f"w{5 + i % 40}" for i in range(CONTEXT_TOKENS + 10))
    status, body = await _post(f"{base_url}/chat/completions", {
        "messages": [{"role": "user", "content": long_prompt}], "stream": stream})
    assert status == 400
    error = body["error"]
    # llama-server's type and numbers; OpenAI's code, which OpenAI's clients look at.
    assert error["type"] == "exceed_context_size_error"
    assert error["code"] == "context_length_exceeded"
    assert error["n_prompt_tokens"] > CONTEXT_TOKENS and error["n_ctx"] == CONTEXT_TOKENS


async def test_the_server_seed_and_max_tokens_fill_and_cap_requests(base_url):
    async with aiohttp.ClientSession() as session, session.get(f"{base_url}/props") as resp:
        params = (await resp.json())["default_generation_settings"]["params"]
    assert params["seed"] == SERVER_SEED and params["n_predict"] == SERVER_MAX_TOKENS
    answers = []
    for extra in ({}, {}, {"n_predict": 50}):
        status, body = await _post(f"{base_url}/completion", {
            "prompt": PROMPT, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
            "ignore_eos": True, **extra})
        assert status == 200, body
        assert body["timings"]["predicted_n"] == SERVER_MAX_TOKENS  # the default, and a cap
        assert body["generation_settings"]["seed"] == SERVER_SEED
        answers.append(body["tokens"] if "tokens" in body else body["content"])
    assert answers[0] == answers[1]  # the server's seed: the same draw each time


@pytest.mark.parametrize("prefix", ["/v1", ""])
async def test_input_tokens_count_the_prompt_a_request_would_run(base_url, prefix):
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": PROMPT}]
    status, counted = await _post(f"{base_url}{prefix}/chat/completions/input_tokens",
                                  {"messages": messages})
    assert status == 200, counted
    _, answer = await _post(f"{base_url}/v1/chat/completions",
                            {"messages": messages, "max_tokens": 1})
    assert counted == {"input_tokens": answer["usage"]["prompt_tokens"]}
    status, counted = await _post(f"{base_url}{prefix}/responses/input_tokens",
                                  {"input": PROMPT, "instructions": "w7 w8"})
    assert status == 200, counted
    _, answer = await _post(f"{base_url}/v1/responses",
                            {"input": PROMPT, "instructions": "w7 w8", "max_output_tokens": 1})
    assert counted == {"object": "response.input_tokens",
                       "input_tokens": answer["usage"]["input_tokens"]}
    # The body is checked as the completion's would be: a field Strata does not know is a 400.
    status, error = await _post(f"{base_url}{prefix}/chat/completions/input_tokens",
                                {"messages": messages, "mirostat": 2})
    assert status == 400 and error["error"]["param"] == "mirostat"


async def test_verbose_adds_the_answer_in_llama_servers_own_terms(base_url):
    messages = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": PROMPT}]
    status, body = await _post(f"{base_url}/chat/completions",
                               {"messages": messages, "max_tokens": 2, "verbose": True})
    assert status == 200, body
    native = body["__verbose"]
    assert "w7 w8" in native["prompt"] and PROMPT in native["prompt"]
    assert native["content"] == body["choices"][0]["message"]["content"]
    assert native["tokens_evaluated"] == body["usage"]["prompt_tokens"]
    assert native["tokens_predicted"] == 2 and native["timings"]["predicted_n"] == 2
    _, plain = await _post(f"{base_url}/chat/completions",
                           {"messages": messages, "max_tokens": 2, "verbose": False})
    assert "__verbose" not in plain
    status, error = await _post(f"{base_url}/chat/completions", {
        "messages": messages, "max_tokens": 2, "verbose": True, "stream": True})
    assert status == 400 and error["error"]["param"] == "verbose"


async def _stream(url: str, body: dict) -> list[dict]:
    chunks = []
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                chunks.append(json.loads(line[6:]))
    return chunks


async def test_completion_streams_prompt_progress_and_timings_per_token(base_url):
    body = {"prompt": PROMPT, "n_predict": 3, "stream": True, "cache_prompt": False,
            "return_progress": True, "timings_per_token": True}
    chunks = await _stream(f"{base_url}/completion", body)
    progress = [c for c in chunks if "prompt_progress" in c]
    first_text = next(i for i, c in enumerate(chunks) if c["tokens"])
    assert progress and chunks[:first_text] == progress  # the prompt's reports come first
    reports = [c["prompt_progress"] for c in progress]
    assert reports[0]["processed"] == reports[0]["cache"] == 0 < reports[0]["total"]
    assert reports[-1]["processed"] == reports[-1]["total"]
    assert all(c["content"] == "" and c["stop"] is False for c in progress)
    # llama-server's timings in every chunk; the first before any prompt token ran.
    assert all("timings" in c for c in chunks)
    assert progress[0]["timings"]["prompt_n"] == 0 and progress[0]["timings"]["prompt_ms"] == 0
    assert chunks[-1]["stop"] is True and chunks[-1]["timings"]["predicted_n"] >= 1
    prompt_ms = [c["timings"]["prompt_ms"] for c in progress]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0
    # Not asked: no reports, and timings only in the last chunk.
    plain = await _stream(f"{base_url}/completion", {**body, "return_progress": False,
                                                     "timings_per_token": False})
    assert not [c for c in plain if "prompt_progress" in c]
    assert [c for c in plain if "timings" in c] == [plain[-1]]
    status, error = await _post(f"{base_url}/completion",
                                {**body, "stream": False})
    assert status == 400 and error["error"]["param"] == "return_progress"


async def test_post_sampling_probs_are_the_distribution_the_sampler_drew_from(base_url):
    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 5, "temperature": 1.0, "top_k": 3,
            "top_p": 1.0, "min_p": 0.0, "seed": 7, "post_sampling_probs": True}
    status, answer = await _post(f"{base_url}/completion", body)
    assert status == 200, answer
    records = answer["completion_probabilities"]
    assert len(records) == 4
    for record in records:
        assert "logprob" not in record and 0 < record["prob"] <= 1
        top = record["top_probs"]
        # top_k 3 keeps three tokens: all of them listed (n_probs 5), their mass is all of it.
        assert 1 <= len(top) <= 3 and sum(t["prob"] for t in top) == pytest.approx(1.0)
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert record["prob"] == pytest.approx(next(t["prob"] for t in top
                                                    if t["id"] == record["id"]))
    # The raw logprobs of the same draw: the chosen token's probability before top_k is less.
    _, raw = await _post(f"{base_url}/completion", {**body, "post_sampling_probs": False})
    assert raw["completion_probabilities"][0]["id"] == records[0]["id"]
    assert math.exp(raw["completion_probabilities"][0]["logprob"]) < records[0]["prob"]
    # Greedy: all the mass on its pick.
    _, greedy = await _post(f"{base_url}/completion", {**body, "temperature": 0})
    assert all(r["prob"] == 1.0 and [t["prob"] for t in r["top_probs"]] == [1.0]
               for r in greedy["completion_probabilities"])
    status, error = await _post(f"{base_url}/completion", {**body, "n_probs": 0})
    assert status == 400 and error["error"]["param"] == "post_sampling_probs"
