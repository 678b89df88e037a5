"""The official openai and anthropic SDKs, unchanged, against the real server and default model."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import ollama
import openai
import pytest

from strata.default_model import default_model_path
from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 48
# anthropic 2.x dropped `temperature` from messages.create; the API field still exists.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                                 timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model_id(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def chat(oai: openai.OpenAI, model_id: str, messages: list[dict], slot: int = 0):
    # Explicitly greedy, whatever the server's defaults: the answers are compared across requests.
    return oai.chat.completions.create(
        model=model_id, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"strata_cache_slot": slot})


def test_models_lists_the_loaded_default_model(oai: openai.OpenAI) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].object == "model"
    assert oai.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_openai_chat_answers_paris(oai: openai.OpenAI, model_id: str) -> None:
    reply = chat(oai, model_id, QUESTION)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10
    assert 0 < reply.usage.completion_tokens < MAX_TOKENS
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_openai_stream_equals_the_non_streamed_answer(oai: openai.OpenAI, model_id: str) -> None:
    expected = chat(oai, model_id, QUESTION, slot=2)
    stream = oai.chat.completions.create(
        model=model_id, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"strata_cache_slot": 2})
    pieces, finish_reasons, usage = [], [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish_reasons.append(chunk.choices[0].finish_reason)
        usage = chunk.usage or usage
    assert "".join(pieces) == expected.choices[0].message.content
    assert len([p for p in pieces if p]) >= 3  # it really streamed, piece by piece
    assert finish_reasons[-1] == "stop" and not any(finish_reasons[:-1])
    assert usage.completion_tokens == expected.usage.completion_tokens
    assert usage.prompt_tokens == expected.usage.prompt_tokens


def test_openai_completions_continue_a_raw_prompt(oai: openai.OpenAI, model_id: str) -> None:
    done = oai.completions.create(model=model_id, prompt="The capital of France is",
                                  temperature=0, max_tokens=6)
    assert "Paris" in done.choices[0].text, done.choices[0].text
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 6


def test_anthropic_messages_answer_paris(claude: anthropic.Anthropic, model_id: str) -> None:
    message = claude.messages.create(model=model_id, max_tokens=MAX_TOKENS, messages=QUESTION,
                                     extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message"
    assert "Paris" in message.content[0].text, message.content
    assert message.stop_reason == "end_turn"
    assert 0 < message.usage.output_tokens < MAX_TOKENS


def test_anthropic_stream_equals_the_non_streamed_answer(
    claude: anthropic.Anthropic, model_id: str
) -> None:
    kwargs = {"model": model_id, "max_tokens": MAX_TOKENS, "messages": QUESTION,
              "extra_body": GREEDY, "system": "Answer in one short sentence."}
    expected = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected.content[0].text
    assert "Paris" in final.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == expected.usage.output_tokens
    # The repeat hit the cache: Anthropic counts those prompt tokens apart.
    assert final.usage.cache_read_input_tokens > 0


def test_follow_up_turn_reuses_the_cache_and_matches_a_cold_slot(
    oai: openai.OpenAI, model_id: str, server: ServerProcess
) -> None:
    first = chat(oai, model_id, QUESTION, slot=1)
    conversation = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And what is the capital of Italy?"}]
    warm = chat(oai, model_id, conversation, slot=1)
    # The whole first prompt is a prefix of the second, so at least that much is reused.
    assert warm.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # Requests without a slot may have used slot 3 (the engine picks empty slots first).
    erase = urllib.request.Request(f"{server.base_url}/slots/3?action=erase", data=b"{}",
                                   headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(erase, timeout=60).close()
    cold = chat(oai, model_id, conversation, slot=3)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert "Rome" in warm.choices[0].message.content, warm.choices[0].message.content


def test_bad_cache_slot_is_refused_before_any_stream(oai: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError, match="strata_cache_slot"):
        oai.chat.completions.create(model=model_id, messages=QUESTION, stream=True,
                                    extra_body={"strata_cache_slot": 9})


def test_ollama_client_finds_and_chats_with_the_model(server: ServerProcess) -> None:
    client = ollama.Client(host=server.base_url, timeout=120)
    listed = client.list().models
    assert len(listed) == 1 and listed[0].details.format == "gguf"
    assert listed[0].details.quantization_level == "Q4_1"
    assert listed[0].size == default_model_path(fetch=False).stat().st_size
    name = listed[0].model
    reply = client.chat(model=name, messages=QUESTION, stream=False,
                        options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert "Paris" in reply.message.content, reply.message.content
    assert reply.done_reason == "stop" and 0 < reply.eval_count < MAX_TOKENS
    streamed = "".join(part.message.content for part in client.chat(
        model=name, messages=QUESTION, stream=True,
        options={"temperature": 0, "num_predict": MAX_TOKENS}))
    assert streamed == reply.message.content
    assert [m.model for m in client.ps().models] == [name]


def test_responses_follow_up_reuses_the_cache(oai: openai.OpenAI, model_id: str) -> None:
    first = oai.responses.create(model=model_id, input="What is the capital of France?",
                                 temperature=0, max_output_tokens=MAX_TOKENS)
    assert "Paris" in first.output_text, first.output_text
    follow = oai.responses.create(model=model_id, input="And what is the capital of Italy?",
                                  previous_response_id=first.id, temperature=0,
                                  max_output_tokens=MAX_TOKENS)
    assert "Rome" in follow.output_text, follow.output_text
    # The whole first turn is a prefix of the follow-up, in the same slot: it is not re-read.
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_slot_save_and_restore_answer_llamacpp_payloads(oai: openai.OpenAI, model_id: str,
                                                        server: ServerProcess) -> None:
    """The real engine's answers, at top level as llama.cpp's clients read them; the API
    tests' fake answers the same keys (tests/api/fake_service.py)."""
    chat(oai, model_id, QUESTION, slot=2)
    saved = _post_json(server, "/slots/2?action=save", {"filename": "e2e.slot"})
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert saved["id_slot"] == 2 and saved["n_saved"] > 10 and saved["n_written"] > 0
    restored = _post_json(server, "/slots/3?action=restore", {"filename": "e2e.slot"})
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert restored["n_restored"] == saved["n_saved"]
    erased = _post_json(server, "/slots/3?action=erase", None)
    assert erased == {"id_slot": 3, "n_erased": saved["n_saved"]}


def _post_json(server: ServerProcess, path: str, body: dict | None) -> dict:
    request = urllib.request.Request(server.base_url + path, method="POST",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


async def test_a_browser_page_streams_from_an_allowed_origin_and_not_from_a_foreign_one(
        server: ServerProcess, tmp_path):
    """Real headless Chromium, real fetch(): CORS preflight and streaming, issue 17 item 2."""
    from tests.e2e.browser import find_browser, open_page, page_server

    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium on PATH (CI installs the Debian package chromium)")
    before = server.status()["counters"]["requests_total"]
    # localhost:* is a default allowed origin; 127.0.0.2 (another loopback address, so
    # another site to the browser) stands in for a foreign site.
    async with page_server(("127.0.0.1", "127.0.0.2")) as (ports, reports):
        allowed = await open_page(
            browser, f"http://localhost:{ports['127.0.0.1']}/page.html?target={server.base_url}",
            reports, tmp_path / "profile-a")
        foreign = await open_page(
            browser, f"http://127.0.0.2:{ports['127.0.0.2']}/page.html?target={server.base_url}",
            reports, tmp_path / "profile-b")
    assert "error" not in allowed, allowed
    assert allowed["status"] == 200  # readable at all: the response carried CORS headers
    events = [line[6:] for line in allowed["body"].split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3, allowed["body"]
    assert "TypeError" in foreign.get("error", ""), foreign  # the preflight was refused
    assert "status" not in foreign
    assert server.status()["counters"]["requests_total"] == before + 1
