"""A JSON schema with `properties` and no `additionalProperties` is a closed object on every
route that turns a schema into a grammar, as llama.cpp and Ollama read it (issue 51 item 10).

Each route's grammar, as sent to the engine, is run through llguidance's matcher on SmolLM2's
real vocabulary: the tokens of an object with an extra key must be refused, those of the
object itself accepted. The grammar forbids the key; no model's luck is involved.
"""

from __future__ import annotations

import llguidance
import pytest
from pydantic import BaseModel, Field

from strata.engine.api.grammar import closed_objects, json_schema_grammar

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
GOOD = '{"name": "Ann", "age": 3}'
EXTRA_KEY = '{"name": "Ann", "age": 3, "city": "Paris"}'


@pytest.fixture(scope="module")
def tokenizer(smollm2) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(smollm2.tokenizer.to_str(), n_vocab=smollm2.vocab_size,
                                  eos_token=list(smollm2.eos_token_ids))


def accepts(tokenizer, smollm2, grammar: str, text: str) -> bool:
    """Whether the grammar takes all of text's tokens and may end there."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = smollm2.encode(text, add_special=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_an_object_with_properties_is_closed_and_strings_keep_their_bounds(tokenizer, smollm2):
    grammar = json_schema_grammar(PERSON, "schema")
    assert accepts(tokenizer, smollm2, grammar, GOOD)
    assert not accepts(tokenizer, smollm2, grammar, EXTRA_KEY)
    assert not accepts(tokenizer, smollm2, grammar, '{"name": "Annabelle", "age": 3}')
    opened = json_schema_grammar({**PERSON, "additionalProperties": True}, "schema")
    assert accepts(tokenizer, smollm2, opened, EXTRA_KEY)


def test_a_pydantic_schema_is_closed_at_every_level(tokenizer, smollm2):
    """pydantic writes no additionalProperties, and nested models go to $defs behind a $ref."""
    class Pet(BaseModel):
        kind: str = Field(max_length=8)

    class Owner(BaseModel):
        name: str = Field(max_length=8)
        pet: Pet

    grammar = json_schema_grammar(Owner.model_json_schema(), "schema")
    assert accepts(tokenizer, smollm2, grammar, '{"name": "Ann", "pet": {"kind": "cat"}}')
    assert not accepts(tokenizer, smollm2, grammar,
                       '{"name": "Ann", "pet": {"kind": "cat", "age": 2}}')
    assert not accepts(tokenizer, smollm2, grammar,
                       '{"name": "Ann", "pet": {"kind": "cat"}, "age": 2}')


def test_objects_that_other_schemas_extend_stay_open():
    """Closing an allOf member, or an object beside an anyOf, would refuse the keys the other
    schemas add; the client's schema is not changed in place."""
    a, b = {"properties": {"a": {}}}, {"properties": {"b": {}}}
    schema = {"allOf": [a, b], "properties": {"c": {}}}
    assert closed_objects(schema, "schema") == schema
    assert "additionalProperties" not in a
    nested = {"type": "array", "items": {"anyOf": [a, {"type": "string"}]}}
    assert closed_objects(nested, "schema")["items"]["anyOf"][0]["additionalProperties"] is False


def _routes(service):
    """(route, body) of every API that takes a schema for the output, with PERSON in it."""
    model = service.model_id
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "person", "schema": PERSON}}}),
        ("/v1/responses", {"input": "hi", "text": {"format": {
            "type": "json_schema", "name": "person", "schema": PERSON}}}),
        ("/v1/messages", {"max_tokens": 20, "messages": [{"role": "user", "content": "hi"}],
                          "output_config": {"format": {"type": "json_schema",
                                                       "schema": PERSON}}}),
        ("/api/chat", {"model": model, "stream": False, "format": PERSON,
                       "messages": [{"role": "user", "content": "hi"}]}),
    ]


async def test_every_route_sends_a_closed_object_grammar(client, service, tokenizer, smollm2):
    for route, body in _routes(service):
        service.reply_text = GOOD
        resp = await client.post(route, json=body)
        assert resp.status == 200, (route, await resp.text())
        grammar = service.requests[-1].sampling.grammar
        assert accepts(tokenizer, smollm2, grammar, GOOD), route
        assert not accepts(tokenizer, smollm2, grammar, EXTRA_KEY), route


async def test_a_forced_tool_calls_arguments_are_a_closed_object(client, service, tokenizer,
                                                                 smollm2):
    """LangChain's @tool schemas omit additionalProperties too."""
    service.context_tokens = 8192
    tool = {"type": "function", "function": {"name": "find", "parameters": PERSON}}
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "find"}}})
    assert resp.status == 200, await resp.text()
    grammar = service.requests[-1].sampling.grammar

    def call(arguments: str) -> str:  # the Hermes form the tiny template's prompt teaches
        return f'<tool_call>\n{{"name": "find", "arguments": {arguments}}}\n</tool_call>'

    assert accepts(tokenizer, smollm2, grammar, call(GOOD))
    assert not accepts(tokenizer, smollm2, grammar, call(EXTRA_KEY))
