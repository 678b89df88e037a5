"""The Ollama routes' part of the OpenAPI document (merged by openapi.py)."""

from __future__ import annotations

from typing import Any

_JSON = "application/json"


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties,
                              "additionalProperties": True}
    if required:
        schema["required"] = list(required)
    return schema


_OPTIONS = _obj({name: {"type": kind} for name, kind in (
    ("num_predict", "integer"), ("temperature", "number"), ("top_k", "integer"),
    ("top_p", "number"), ("min_p", "number"), ("seed", "integer"), ("num_ctx", "integer"),
    ("stop", ["array", "string"]))})
_COMMON = {"model": {"type": "string", "description": "the served model, as /api/tags names it"},
           "stream": {"type": "boolean", "default": True, "description": "NDJSON when true"},
           "options": _OPTIONS,
           "keep_alive": {"type": ["string", "number"],
                          "description": "maps onto the unload idle timer; 0 unloads after"}}
_DETAILS = _obj({"format": {"type": "string"}, "family": {"type": "string"},
                 "parameter_size": {"type": "string"}, "quantization_level": {"type": "string"}})
_TIMINGS = {name: {"type": "integer"} for name in (
    "total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
    "eval_count", "eval_duration")}
_THINK = "think"
_THINK_SCHEMA = {"oneOf": [{"type": "boolean"}, {"enum": ["low", "medium", "high"]}],
                 "description": "split a thinking model's reasoning into `thinking` (true), "
                 "turn thinking off (false), or a reasoning effort (gpt-oss)"}
_TOOL_CALL = _obj({"id": {"type": "string"}, "function": _obj({
    "index": {"type": "integer"}, "name": {"type": "string"},
    "arguments": {"type": "object"}}, ("name", "arguments"))}, ("function",))

SCHEMAS: dict[str, Any] = {
    "OllamaError": _obj({"error": {"type": "string"}}, ("error",)),
    "OllamaChatRequest": _obj({**_COMMON, _THINK: _THINK_SCHEMA, "messages": {
        "type": "array", "minItems": 1, "items": _obj({
            "role": {"enum": ["system", "user", "assistant", "tool"]},
            "content": {"type": "string"}, "thinking": {"type": "string"},
            "tool_calls": {"type": "array", "items": _TOOL_CALL},
            "tool_name": {"type": "string"}, "tool_call_id": {"type": "string"}},
            ("role",))},
        "tools": {"type": "array", "items": _obj({"type": {"const": "function"},
                                                  "function": _obj({
                                                      "name": {"type": "string"},
                                                      "description": {"type": "string"},
                                                      "parameters": {"type": "object"}},
                                                      ("name",))}, ("type", "function"))}},
        ("model", "messages")),
    "OllamaGenerateRequest": _obj({**_COMMON, _THINK: _THINK_SCHEMA,
                                   "prompt": {"type": "string"},
                                   "system": {"type": "string"}, "raw": {"type": "boolean"}},
                                  ("model",)),
    "OllamaChat": _obj({"model": {"type": "string"}, "created_at": {"type": "string"},
                        "message": _obj({"role": {"const": "assistant"},
                                         "content": {"type": "string"},
                                         "thinking": {"type": "string"},
                                         "tool_calls": {"type": "array",
                                                        "items": _TOOL_CALL}}),
                        "done": {"type": "boolean"}, "done_reason": {"type": "string"},
                        **_TIMINGS}),
    "OllamaGenerate": _obj({"model": {"type": "string"}, "created_at": {"type": "string"},
                            "response": {"type": "string"}, "thinking": {"type": "string"},
                            "done": {"type": "boolean"},
                            "done_reason": {"type": "string"}, **_TIMINGS}),
    "OllamaModels": _obj({"models": {"type": "array", "items": _obj({
        "name": {"type": "string"}, "model": {"type": "string"}, "size": {"type": "integer"},
        "digest": {"type": "string"}, "details": _DETAILS,
        "size_vram": {"type": "integer"}, "expires_at": {"type": "string"}})}}, ("models",)),
    "OllamaShowRequest": _obj({"model": {"type": "string"}}, ("model",)),
    "OllamaPullRequest": _obj({
        "model": {"type": "string", "description": "hf.co/OWNER/REPO:QUANT (Q4_K_M when "
                  "untagged) or OWNER/REPO[:FILE] of the Hugging Face hub; Ollama's own "
                  "registry names are refused"},
        "name": {"type": "string", "description": "older spelling of model"},
        "insecure": {"const": False}, "stream": _COMMON["stream"]}),
    "OllamaPullProgress": _obj({
        "status": {"type": "string", "description": "pulling manifest | pulling FILE | "
                   "verifying sha256 digest | success"},
        "digest": {"type": "string"}, "total": {"type": "integer"},
        "completed": {"type": "integer"}, "error": {"type": "string"}}, ("status",)),
}


def paths(op, ok, body) -> dict[str, Any]:
    """Ollama's paths, built with openapi.py's helpers (op, ok, body) and OllamaError."""
    stream_text = "The answer; application/x-ndjson lines when stream is true"
    return {
        "/api/version": {"get": op("The Ollama API level served", "Ollama", ok(None))},
        "/api/tags": {"get": op("The models this server can run", "Ollama",
                                ok("OllamaModels"))},
        "/api/ps": {"get": op("The model while it holds memory", "Ollama", ok("OllamaModels"))},
        "/api/show": {"post": op("Details and chat template of a model", "Ollama", ok(None),
                                 404, body=body("OllamaShowRequest"))},
        "/api/chat": {"post": op("Ollama chat", "Ollama", ok("OllamaChat", stream_text), 400,
                                 404, 503, body=body("OllamaChatRequest"))},
        "/api/generate": {"post": op("Ollama generate; an empty prompt loads or unloads",
                                     "Ollama", ok("OllamaGenerate", stream_text), 400, 404,
                                     503, body=body("OllamaGenerateRequest"))},
        "/api/pull": {"post": op("Fetch a model from the Hugging Face hub into the library",
                                 "Ollama", ok("OllamaPullProgress", "The final object; "
                                              "application/x-ndjson progress lines when "
                                              "stream is true"), 400, 404, 502, 503,
                                 body=body("OllamaPullRequest"))},
    }
