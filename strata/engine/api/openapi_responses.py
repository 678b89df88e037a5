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

SCHEMAS: dict[str, Any] = {
    "ResponsesRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": _MESSAGE}]},
        "instructions": {"type": "string"},
        "previous_response_id": {"type": "string",
                                 "description": "continue a stored response in its cache slot"},
        "store": {"type": "boolean", "default": True},
        "max_output_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean", "default": False},
        "metadata": {"type": "object"}}},
    "Response": {"type": "object", "additionalProperties": True, "properties": {
        "id": {"type": "string"}, "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete", "in_progress"]},
        "output": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": ["object", "null"]}}},
}


def paths(op, ok, body) -> dict[str, Any]:
    """The /v1/responses paths, built with openapi.py's helpers."""
    stream_text = "The response; text/event-stream when stream is true"
    return {
        "/v1/responses": {"post": op("OpenAI Responses: text in, text out", "OpenAI",
                                     ok("Response", stream_text, stream=True), 400, 503,
                                     body=body("ResponsesRequest"))},
        "/v1/responses/{response_id}": {"get": {
            **op("A stored response", "OpenAI", ok("Response"), 404),
            "parameters": [{"name": "response_id", "in": "path", "required": True,
                            "schema": {"type": "string"}}]}},
    }
