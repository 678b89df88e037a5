"""The embedding routes' part of the OpenAPI document (merged by openapi.py)."""

from __future__ import annotations

from typing import Any


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (),
         **extra: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_INPUT = {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _IDS, {"type": "array", "minItems": 1, "items": _IDS}],
    "description": "text, texts, token ids or lists of token ids"}
_VECTOR = {"type": "array", "items": {"type": "number"},
           "description": "the model's final hidden state, pooled, L2-normalized"}
_DIMENSIONS = {"type": "integer", "minimum": 1,
               "description": "only the model's hidden size; other values are a 400"}
_MODEL = {"type": "string", "description": "the served model, as /api/tags names it"}
_KEEP_ALIVE = {"type": ["string", "number"],
               "description": "maps onto the unload idle timer; 0 unloads after"}
_OPTIONS = _obj({"num_ctx": {"type": "integer", "minimum": 1}}, additionalProperties=False,
                description="only num_ctx applies to embeddings")

SCHEMAS: dict[str, Any] = {
    "EmbeddingRequest": _obj({
        "input": _INPUT, "model": {"type": "string", "description": "ignored: one model"},
        "encoding_format": {"enum": ["float", "base64"], "default": "float",
                            "description": "base64: little-endian float32 bytes"},
        "dimensions": _DIMENSIONS,
        "user": {"type": "string", "description": "a label; does not change the output"}},
        ("input",), additionalProperties=False),
    "EmbeddingList": _obj({
        "object": {"const": "list"}, "model": {"type": "string"},
        "data": {"type": "array", "items": _obj({
            "object": {"const": "embedding"}, "index": {"type": "integer"},
            "embedding": {"oneOf": [_VECTOR, {"type": "string"}]}})},
        "usage": _obj({"prompt_tokens": {"type": "integer"},
                       "total_tokens": {"type": "integer"}})}),
    "LlamaEmbeddingRequest": _obj({
        "content": _INPUT, "input": _INPUT, "model": {"type": "string"},
        "embd_normalize": {"type": "integer", "minimum": 0, "default": 2,
                           "description": "2: euclidean, 1: taxicab, p > 2: p-norm, 0: "
                           "max-absolute to int16 range; -1 (none) is refused"}},
        additionalProperties=False),
    "LlamaEmbeddings": {"type": "array", "items": _obj({
        "index": {"type": "integer"},
        "embedding": {"type": "array", "items": _VECTOR, "description": "one pooled vector"}})},
    "OllamaEmbedRequest": _obj({
        "model": _MODEL, "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {
            "type": "string"}}], "description": "empty or absent: only load the model"},
        "truncate": {"type": "boolean", "default": True,
                     "description": "cut inputs to the context; false: a 400 instead"},
        "dimensions": _DIMENSIONS, "options": _OPTIONS, "keep_alive": _KEEP_ALIVE},
        ("model",), additionalProperties=False),
    "OllamaEmbed": _obj({
        "model": {"type": "string"}, "embeddings": {"type": "array", "items": _VECTOR},
        **{name: {"type": "integer"} for name in ("total_duration", "load_duration",
                                                   "prompt_eval_count")}}),
    "OllamaEmbeddingsRequest": _obj({
        "model": _MODEL, "prompt": {"type": "string", "description": "empty: only load"},
        "options": _OPTIONS, "keep_alive": _KEEP_ALIVE}, ("model",),
        additionalProperties=False),
    "OllamaEmbeddings": _obj({"embedding": _VECTOR}),
}


def paths(op, ok, body) -> dict[str, Any]:
    """The embedding paths, built with openapi.py's helpers (op, ok, body)."""
    return {
        "/v1/embeddings": {"post": op("OpenAI embeddings", "OpenAI", ok("EmbeddingList"),
                                      400, 503, body=body("EmbeddingRequest"))},
        "/embeddings": {"post": op("Alias of /v1/embeddings", "OpenAI", ok("EmbeddingList"),
                                   400, 503, body=body("EmbeddingRequest"))},
        "/embedding": {"post": op("llama.cpp embeddings", "llama.cpp", ok("LlamaEmbeddings"),
                                  400, 503, body=body("LlamaEmbeddingRequest"))},
        "/api/embed": {"post": op("Ollama embeddings", "Ollama", ok("OllamaEmbed"), 400, 404,
                                  503, body=body("OllamaEmbedRequest"))},
        "/api/embeddings": {"post": op("Ollama's older embeddings route", "Ollama",
                                       ok("OllamaEmbeddings"), 400, 404, 503,
                                       body=body("OllamaEmbeddingsRequest"))},
    }
