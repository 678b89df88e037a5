"""The Responses API's part of the OpenAPI document (merged by openapi.py)."""

from __future__ import annotations

from typing import Any

_TEXT_PART = {"type": "object", "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
    "required": ["type", "text"]}
_MESSAGE = {"type": "object", "properties": {
    "type": {"const": "message"}, "role": {"enum": ["system", "developer", "user", "assistant"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}},
    "required": ["role", "content"]}
_FUNCTION_CALL = {"type": "object", "properties": {
    "type": {"const": "function_call"}, "call_id": {"type": "string"},
    "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text"}},
    "required": ["type", "call_id", "name", "arguments"]}
_CALL_OUTPUT = {"type": "object", "properties": {
    "type": {"const": "function_call_output"}, "call_id": {"type": "string"},
    "output": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}},
    "required": ["type", "call_id", "output"]}
_TOOL = {"type": "object", "properties": {
    "type": {"const": "function"}, "name": {"type": "string"},
    "description": {"type": "string"}, "parameters": {"type": "object"},
    "strict": {"type": "boolean", "description": "the schema is enforced when tool_choice "
               "forces the call; in auto mode arguments come back as the model wrote them"}},
    "required": ["type", "name"]}

# A reasoning output item sent back: its reasoning_text goes to the next assistant turn.
_REASONING = {"type": "object", "properties": {
    "type": {"const": "reasoning"}, "content": {"type": "array", "items": {
        "type": "object", "properties": {"type": {"const": "reasoning_text"},
                                         "text": {"type": "string"}}}}},
    "required": ["type"]}

SCHEMAS: dict[str, Any] = {
    "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {
                                "oneOf": [_MESSAGE, _REASONING, _FUNCTION_CALL,
                                          _CALL_OUTPUT]}}]},
        "tools": {"type": "array", "items": _TOOL},
        "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, {
            "type": "object", "properties": {"type": {"const": "function"},
                                             "name": {"type": "string"}},
            "required": ["type", "name"]}]},
        "parallel_tool_calls": {"type": "boolean", "default": True},
        "instructions": {"type": "string"},
        "previous_response_id": {"type": "string",
                                 "description": "continue a stored response in its cache slot"},
        "store": {"type": "boolean", "default": True},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean", "default": False},
        "metadata": {"type": "object"},
        "text": {"type": "object", "properties": {"format": {
            "type": "object", "required": ["type"], "description": "structured output, "
            "enforced by constrained decoding",
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                           "name": {"type": "string"}, "description": {"type": "string"},
                           "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
        "reasoning": {"type": "object", "properties": {
            "effort": {"enum": ["low", "medium", "high"],
                       "description": "for a template that takes it (gpt-oss); else a 400"}}}}},
    "Response": {"type": "object", "additionalProperties": True, "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete", "in_progress"]},
        "output": {"type": "array", "items": {"type": "object", "properties": {
            "type": {"enum": ["reasoning", "message", "function_call"]}}}},
        "usage": {"type": ["object", "null"]}}},
}


def paths(op, ok, body) -> dict[str, Any]:
    """The /v1/responses paths, built with openapi.py's helpers."""
    stream_text = "The response; text/event-stream when stream is true"
    return {
        "/v1/responses": {"post": op("OpenAI Responses: text, JSON and function calls", "OpenAI",
                                     ok("Response", stream_text, stream=True), 400, 503,
                                     body=body("ResponsesRequest"))},
        "/v1/responses/{response_id}": {"get": {
            **op("A stored response", "OpenAI", ok("Response"), 404),
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
        "/responses": {"post": op("Alias of /v1/responses", "OpenAI",
                                  ok("Response", stream_text, stream=True), 400, 503,
                                  body=body("ResponsesRequest"))},
        "/v1/responses/input_tokens": {"post": op(
            "Count a Responses request's prompt tokens", "OpenAI", ok("ResponseInputTokens"),
            400, body=body("ResponsesRequest"))},
        "/responses/input_tokens": {"post": op(
            "Alias of /v1/responses/input_tokens", "OpenAI", ok("ResponseInputTokens"), 400,
            body=body("ResponsesRequest"))},
        "/responses/{response_id}": {"get": {
            **op("Alias of /v1/responses/{response_id}", "OpenAI", ok("Response"), 404),
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
    }
