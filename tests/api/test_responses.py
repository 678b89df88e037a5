"""OpenAI's Responses API through the official openai SDK's `client.responses`."""

from __future__ import annotations

import openai
import pytest

from strata.engine.api import create_app


@pytest.fixture
async def oai(aiohttp_server, service):
    server = await aiohttp_server(create_app(service))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k",
                                max_retries=0)
    yield client
    await client.close()


async def test_text_in_text_out(oai, service):
    response = await oai.responses.create(model="m", input="What is the answer?",
                                          instructions="Be brief.", max_output_tokens=64)
    assert response.status == "completed"
    assert response.output_text == service.reply_text
    assert response.usage.output_tokens == len(service.reply_ids())
    assert response.usage.input_tokens_details.cached_tokens == 3
    stored = await oai.responses.retrieve(response.id)
    assert stored.output_text == service.reply_text
    prompt = service.text.decode(list(service.requests[-1].prompt_ids), skip_special=False)
    assert "Be brief." in prompt and "What is the answer?" in prompt


async def test_max_output_tokens_makes_it_incomplete(oai, service):
    response = await oai.responses.create(model="m", input="hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


async def test_stream_events_in_openai_order(oai, service):
    kinds, deltas, final = [], [], None
    stream = await oai.responses.create(model="m", input="hi", stream=True)
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == service.reply_text == final.output_text


async def test_follow_up_continues_the_conversation_in_its_slot(oai, service):
    first = await oai.responses.create(model="m", input="What is the answer?")
    await oai.responses.create(model="m", input="Something else")
    follow = await oai.responses.create(model="m", input="And why?",
                                        previous_response_id=first.id)
    first_request, other_request, follow_request = service.requests
    # New conversations name no slot (the engine picks); the follow-up runs in the slot the
    # engine reported for the first turn (Done.slot), not the other conversation's.
    assert first_request.slot is None and other_request.slot is None
    assert follow_request.slot == service.done_slots[0] != service.done_slots[1]
    assert follow_request.prompt_ids[:len(first_request.prompt_ids)] == \
        first_request.prompt_ids
    history = service.text.decode(list(follow_request.prompt_ids), skip_special=False)
    assert service.reply_text in history and "And why?" in history
    assert follow.previous_response_id == first.id


async def test_a_failure_mid_stream_ends_with_error_and_failed(oai, service):
    service.fail_after = 2
    stream = await oai.responses.create(model="m", input="hi", stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "fell over" in events[-2].message
    assert events[-1].response.status == "failed"
    assert "fell over" in events[-1].response.error.message


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
])
async def test_what_is_not_honoured_is_a_400_naming_it(oai, service, extra, field):
    with pytest.raises(openai.BadRequestError) as raised:
        await oai.responses.create(model="m", input="hi", extra_body=extra)
    assert field in str(raised.value)
    assert not service.requests


async def test_text_format_json_schema_is_enforced_and_parsed_by_the_sdk(oai, service):
    """client.responses.parse (and .stream) with a pydantic text_format: the schema goes to
    the engine as a grammar, the format is echoed, the SDK parses the output (issue 51 item 9)."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: int

    service.reply_text = '{"answer": 42}'
    response = await oai.responses.parse(model="m", input="The answer?", text_format=Answer)
    assert response.output_parsed == Answer(answer=42)
    assert response.text.format.type == "json_schema" and response.text.format.name == "Answer"
    grammar = service.requests[-1].sampling.grammar
    assert grammar is not None and '"answer"' in grammar
    async with oai.responses.stream(model="m", input="The answer?", text_format=Answer) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == service.reply_text and final.output_parsed == Answer(answer=42)
    assert service.requests[-1].sampling.grammar == grammar
    plain = await oai.responses.create(model="m", input="hi",
                                       text={"format": {"type": "json_object"}})
    assert plain.text.format.type == "json_object"
    assert service.requests[-1].sampling.grammar is not None
