"""The official openai and anthropic SDKs, unchanged, against the real server and default model."""

from __future__ import annotations

import anthropic
import openai
import pytest

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
    oai: openai.OpenAI, model_id: str
) -> None:
    first = chat(oai, model_id, QUESTION, slot=1)
    conversation = [*QUESTION, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And what is the capital of Italy?"}]
    warm = chat(oai, model_id, conversation, slot=1)
    # The whole first prompt is a prefix of the second, so at least that much is reused.
    assert warm.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    cold = chat(oai, model_id, conversation, slot=3)  # slot 3 has never been used
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert "Rome" in warm.choices[0].message.content, warm.choices[0].message.content


def test_bad_cache_slot_is_refused_before_any_stream(oai: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.BadRequestError, match="strata_cache_slot"):
        oai.chat.completions.create(model=model_id, messages=QUESTION, stream=True,
                                    extra_body={"strata_cache_slot": 9})
