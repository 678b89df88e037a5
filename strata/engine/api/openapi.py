"""The OpenAPI 3.1 document of every route, served at GET /openapi.json.

Written by hand, not generated from handlers: the handlers parse JSON themselves. A test keeps
it honest by comparing the document's operations with the routes the app registers.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from aiohttp import web

from strata import __version__
from strata.engine.api import openapi_embeddings, openapi_ollama, openapi_responses
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.validation import MAX_STOP_STRINGS
from strata.engine.protocol import NUM_CACHE_SLOTS

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = (), **extra: Any) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, **extra}
    if required:
        schema["required"] = list(required)
    return schema


def _num(minimum: float, maximum: float, default: float, text: str) -> dict:
    return {"type": "number", "minimum": minimum, "maximum": maximum, "default": default,
            "description": text}


_STRING_OR_TEXT_PARTS = {"oneOf": [
    {"type": "string"},
    {"type": "array", "items": _obj({"type": {"const": "text"}, "text": {"type": "string"}},
                                    ("type", "text"))}]}
_SLOT = {"type": "integer", "minimum": 0, "maximum": NUM_CACHE_SLOTS - 1,
         "description": "KV cache slot: each keeps its own conversation prefix for reuse; "
         "left out, the server picks the slot sharing the longest prefix"}
# Where the slot ids' maximum is, set per server from its configured --slots.
_SLOT_FIELDS = ("strata_cache_slot", "id_slot")
_STOPS = {"oneOf": [{"type": "string", "minLength": 1},
                    {"type": "array", "maxItems": MAX_STOP_STRINGS,
                     "items": {"type": "string", "minLength": 1}}]}
_DEFAULTED = "default: the server's, shown by GET /props"
_SAMPLING = {
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "description": _DEFAULTED},
    "top_k": {"type": "integer", "minimum": 0, "description": f"0: off; {_DEFAULTED}"},
    "stream": {"type": "boolean", "default": False},
    "strata_cache_slot": _SLOT,
    "id_slot": {**_SLOT, "description": "llama.cpp's name for strata_cache_slot"},
}
_OPENAI_SAMPLING = {
    **_SAMPLING, "model": {"type": "string", "description": "ignored: one model is served"},
    "max_tokens": {"type": "integer", "minimum": 1,
                   "description": "default: the rest of the context"},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2,
                    "description": f"0 is greedy; {_DEFAULTED}"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1,
              "description": f"0: off; {_DEFAULTED}"},
    "seed": {"type": "integer"},
    "stop": _STOPS,
    "n": {"type": "integer", "minimum": 1, "maximum": 8, "default": 1,
          "description": "choices of the one prompt; choice i samples with seed + i"},
    "presence_penalty": _num(-2, 2, 0, "subtracted once from each token in the window"),
    "frequency_penalty": _num(-2, 2, 0, "subtracted per occurrence in the window"),
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10,
                           "description": f"llama.cpp's repeat_penalty; {_DEFAULTED}"},
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
    "repeat_last_n": {"type": "integer", "minimum": -1,
                      "description": f"the penalty window; -1: all; {_DEFAULTED}"},
    "logit_bias": {"type": "object", "additionalProperties": {
        "type": "number", "minimum": -100, "maximum": 100},
        "description": "token id -> bias added to its logit"},
    "user": {"type": "string", "description": "a label; does not change the output"},
    "metadata": {"type": "object", "description": "a label; does not change the output"},
    "store": {"const": False, "description": "no completions are stored"},
    "stream_options": _obj({"include_usage": {"type": "boolean", "default": False}}),
}
_OUTPUT = {  # structured output: enforced by constrained decoding (docs/api.md)
    "response_format": _obj({"type": {"enum": ["text", "json_object", "json_schema"]},
                             "json_schema": _obj({"name": {"type": "string"},
                                                  "schema": {"type": "object"},
                                                  "strict": {"type": "boolean"}})},
                            ("type",)),
    "json_schema": {"type": "object", "description": "llama.cpp: a JSON schema to enforce"},
    "grammar": {"type": "string", "description": "llama.cpp: a GBNF grammar to enforce"},
}
_FUNCTION_TOOL = _obj({"type": {"const": "function"}, "function": _obj({
    "name": {"type": "string"}, "description": {"type": "string"},
    "parameters": {"type": "object"}}, ("name",))}, ("type", "function"))
_CHAT_EXTRA = {
    **_OUTPUT,
    "tools": {"type": "array", "items": _FUNCTION_TOOL},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, _obj({
        "type": {"const": "function"}, "function": _obj({"name": {"type": "string"}})})]},
    "parallel_tool_calls": {"type": "boolean", "default": True},
    "chat_template_kwargs": {"type": "object"},
    "enable_thinking": {"type": "boolean"},
    "reasoning_effort": {"enum": ["low", "medium", "high"],
                         "description": "for a template that takes it (gpt-oss); else a 400"},
}
_TOOL_CALL = _obj({"id": {"type": "string"}, "type": {"const": "function"},
                   "function": _obj({"name": {"type": "string"},
                                     "arguments": {"type": "string"}})})
_BLOCKS = {"oneOf": [{"type": "string"}, {"type": "array", "items": _obj(
    {"type": {"enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]}},
    ("type",))}]}
_ANTHROPIC_EXTRA = {
    "tools": {"type": "array", "items": _obj({"name": {"type": "string"},
                                              "description": {"type": "string"},
                                              "input_schema": {"type": "object"}},
                                             ("name",))},
    "tool_choice": _obj({"type": {"enum": ["auto", "any", "tool", "none"]},
                         "name": {"type": "string"},
                         "disable_parallel_tool_use": {"type": "boolean"}}, ("type",)),
    "thinking": _obj({"type": {"enum": ["enabled", "disabled", "adaptive"]},
                      "budget_tokens": {"type": "integer", "minimum": 1024}}, ("type",)),
    "output_config": _obj({"format": _obj({"type": {"const": "json_schema"},
                                           "schema": {"type": "object"}})}),
}
_USAGE = _obj({"prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
               "total_tokens": {"type": "integer"},
               "prompt_tokens_details": _obj({"cached_tokens": {
                   "type": "integer", "description": "prompt tokens reused from the slot"}})})
_ANTHROPIC_USAGE = _obj({
    "input_tokens": {"type": "integer", "description": "prompt tokens not read from the cache"},
    "output_tokens": {"type": "integer"},
    "cache_read_input_tokens": {"type": "integer"},
    "cache_creation_input_tokens": {"type": "integer"}})
_FINISH = {"enum": ["stop", "length", "tool_calls", None]}

SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": _obj({"message": {"type": "string"}, "type": {"type": "string"},
                                  "param": {"type": ["string", "null"]},
                                  "code": {"type": "string"}}, ("message", "type", "code"))},
                  ("error",)),
    "AnthropicError": _obj({"type": {"const": "error"}, "error": _obj(
        {"type": {"type": "string"}, "message": {"type": "string"}}, ("type", "message"))},
        ("type", "error")),
    "ChatMessage": _obj({"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                         "content": {"oneOf": [_STRING_OR_TEXT_PARTS, {"type": "null"}]},
                         "tool_calls": {"type": "array", "items": _TOOL_CALL},
                         "tool_call_id": {"type": "string"},
                         "reasoning_content": {"type": "string"}},
                        ("role",)),
    "ChatCompletionRequest": _obj({
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        **_OPENAI_SAMPLING, **_CHAT_EXTRA, "logprobs": {"type": "boolean", "default": False},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}},
        ("messages",), additionalProperties=False),
    "ChatCompletion": _obj({
        "id": {"type": "string"}, "object": {"const": "chat.completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": _obj({
            "index": {"type": "integer"},
            "message": _obj({"role": {"const": "assistant"},
                             "content": {"type": ["string", "null"]},
                             "reasoning_content": {"type": "string"},
                             "tool_calls": {"type": "array", "items": _TOOL_CALL}}),
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": _FINISH})},
        "usage": _USAGE}),
    "CompletionRequest": _obj({
        "prompt": {"oneOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": {"type": "integer"}}]},
        **_OPENAI_SAMPLING, **_OUTPUT, "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": {"const": False}, "suffix": {"type": "null"}, "best_of": {"const": 1}},
        ("prompt",),
        additionalProperties=False),
    "Completion": _obj({
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": {"type": "integer"}, "model": {"type": "string"},
        "choices": {"type": "array", "items": _obj({
            "index": {"type": "integer"}, "text": {"type": "string"},
            "logprobs": {"type": ["object", "null"]}, "finish_reason": _FINISH})},
        "usage": _USAGE}),
    "LlamaCompletionRequest": _obj({
        "prompt": {"description": "a string, token ids (strings mixed in), {prompt_string}, "
                   "or a list of those (answered with a list, not streamed)",
                   "oneOf": [{"type": "string", "minLength": 1},
                             {"type": "object", "properties": {"prompt_string": {
                                 "type": "string"}}},
                             {"type": "array", "minItems": 1, "maxItems": 64}]},
        "n_predict": {"type": "integer", "minimum": -1, "default": -1,
                      "description": "tokens to generate; -1: until the end (not 0)"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_k": {"type": "integer", "minimum": 0}, "top_p": {"type": "number"},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repeat_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "repeat_last_n": {"type": "integer", "minimum": -1},
        "presence_penalty": _num(-2, 2, 0, "subtracted once per token in the window"),
        "frequency_penalty": _num(-2, 2, 0, "subtracted per occurrence in the window"),
        "seed": {"type": "integer", "default": -1, "description": "-1: random"},
        "stop": _STOPS, "stream": {"type": "boolean", "default": False},
        "n_probs": {"type": "integer", "minimum": 0, "maximum": 20, "default": 0},
        "id_slot": {"type": "integer", "minimum": -1, "maximum": NUM_CACHE_SLOTS - 1},
        "cache_prompt": {"type": "boolean", "default": True,
                         "description": "false: evaluate the whole prompt, no cached prefix"},
        "ignore_eos": {"type": "boolean", "default": False,
                       "description": "ban the end-of-sequence tokens"},
        "return_tokens": {"type": "boolean", "default": False,
                          "description": "the generated token ids in `tokens`"},
        "response_fields": {"type": "array", "maxItems": 64, "items": {"type": "string"},
                            "description": "answer only these (paths such as "
                            "generation_settings/n_predict)"},
        "logit_bias": {"type": ["array", "object"]},
        "model": {"type": "string"}}, ("prompt",), additionalProperties=False),
    "LlamaCompletion": _obj({
        "content": {"type": "string"}, "stop": {"type": "boolean"},
        "stop_type": {"enum": ["eos", "limit", "word"]}, "stopping_word": {"type": "string"},
        "tokens_predicted": {"type": "integer"}, "tokens_evaluated": {"type": "integer"},
        "tokens_cached": {"type": "integer"}, "index": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "id_slot": {**_SLOT, "description": "the slot it ran in"}, "model": {"type": "string"},
        "prompt": {"type": "string"}, "has_new_line": {"type": "boolean"},
        "truncated": {"type": "boolean"},
        "generation_settings": {"type": "object",
                                "description": "what the generation ran with"},
        "timings": _obj({name: {"type": "number"} for name in (
            "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
            "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second")}),
        "completion_probabilities": {"type": "array", "items": {"type": "object"}}}),
    "Model": _obj({"id": {"type": "string"}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"},
                   "status": {"enum": ["loaded", "sleeping", "unloaded"]},
                   "context_tokens": {"type": "integer"}}),
    "ModelList": _obj({"object": {"const": "list"},
                       "data": {"type": "array", "items": _ref("Model")}}),
    "MessagesRequest": _obj({
        "model": {"type": "string", "description": "ignored: one model is served"},
        "messages": {"type": "array", "minItems": 1, "items": _obj({
            "role": {"enum": ["user", "assistant"]}, "content": _BLOCKS},
            ("role", "content"))},
        "system": _STRING_OR_TEXT_PARTS,
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1,
                        "description": f"0 is greedy; {_DEFAULTED}"},
        "metadata": {"type": "object", "description": "a label; does not change the output"},
        "stop_sequences": {"type": "array", "maxItems": 64,
                           "items": {"type": "string", "minLength": 1}},
        **_SAMPLING, **_ANTHROPIC_EXTRA}, ("messages", "max_tokens"), additionalProperties=False),
    "Message": _obj({
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"},
        "content": {"type": "array", "items": _obj({
            "type": {"enum": ["text", "thinking", "tool_use"]}, "text": {"type": "string"},
            "thinking": {"type": "string"}, "id": {"type": "string"},
            "name": {"type": "string"}, "input": {"type": "object"}})},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {"type": ["string", "null"]}, "usage": _ANTHROPIC_USAGE}),
    "CountTokensRequest": _obj({"messages": {"type": "array", "minItems": 1},
                                "system": _STRING_OR_TEXT_PARTS, **_ANTHROPIC_EXTRA},
                               ("messages",)),
    "TokenCount": _obj({"input_tokens": {"type": "integer"}}, ("input_tokens",)),
    "ResponseInputTokens": _obj({"object": {"const": "response.input_tokens"},
                                 "input_tokens": {"type": "integer"}},
                                ("object", "input_tokens")),
    "Health": _obj({"status": {"enum": ["ok", "loading", "error"]},
                    "state": {"type": "string"}}, ("status", "state")),
    "Status": _obj({
        "state": {"type": "string", "description": "loaded, sleeping, unloaded, loading, ..."},
        "model": {"type": "string"}, "model_path": {"type": ["string", "null"]},
        "context_tokens": {"type": "integer"}, "queue_length": {"type": "integer"},
        "is_busy": {"type": "boolean"}, "engine_pid": {"type": ["integer", "null"]},
        "last_error": {"type": ["string", "null"]}},
        ("state",), additionalProperties=True,
        description="The service's whole snapshot; levels, bytes and timers as they are built"),
    "Tokenize": _obj({"content": {"type": "string"},
                      "add_special": {"type": "boolean", "default": False},
                      "with_pieces": {"type": "boolean", "default": False}}, ("content",)),
    "Tokens": _obj({"tokens": {"type": "array", "items": {"oneOf": [
        {"type": "integer"},
        _obj({"id": {"type": "integer"}, "piece": {"type": "string"}})]}}}, ("tokens",)),
    "Detokenize": _obj({"tokens": {"type": "array", "items": {"type": "integer"}}},
                       ("tokens",)),
    "Content": _obj({"content": {"type": "string"}}, ("content",)),
    "Prompt": _obj({"prompt": {"type": "string"}}, ("prompt",)),
    "SlotFile": _obj({"filename": {"type": "string", "minLength": 1, "maxLength": 255,
                                   "description": "a plain name inside the snapshot directory"}},
                     ("filename",)),
    "ActionResult": _obj({"action": {"type": "string"}}, additionalProperties=True,
                         description="What was done, and the status snapshot after it"),
}

# /infill takes /completion's fields, its prompt (text after the middle token) optional.
SCHEMAS["LlamaInfillRequest"] = {
    **SCHEMAS["LlamaCompletionRequest"], "required": [], "properties": {
        **SCHEMAS["LlamaCompletionRequest"]["properties"],
        "prompt": {"type": "string", "description": "text after the middle token"},
        "input_prefix": {"type": "string"}, "input_suffix": {"type": "string"},
        "input_extra": {"type": "array", "items": _obj({"filename": {"type": "string"},
                                                        "text": {"type": "string"}}),
                        "description": "other files, each after the file separator token"}}}


def _body(schema: str, required: bool = True) -> dict:
    return {"required": required, "content": {_JSON: {"schema": _ref(schema)}}}


def _ok(schema: str | None, text: str = "OK", *, stream: bool = False) -> dict:
    content: dict[str, Any] = {_JSON: {"schema": _ref(schema) if schema else {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": text, "content": content}


def _errors(*statuses: int, anthropic: bool = False, ollama: bool = False) -> dict[str, Any]:
    words = {400: "Invalid request", 401: "Missing or wrong API key",
             403: "Foreign Host or cross-site Origin", 404: "Not found",
             409: "A request is running", 503: "Not enough VRAM or the engine is down; "
             "see Retry-After", 500: "A server-side fault, such as a read-only snapshot "
             "directory", 502: "The Hugging Face hub did not deliver (network, hub error)",
             507: "The server's disk is full"}
    schema = _ref("AnthropicError" if anthropic else "OllamaError" if ollama else "Error")
    return {str(s): {"description": words[s], "content": {_JSON: {"schema": schema}}}
            for s in statuses}


def _op(summary: str, tag: str, ok: dict, *errors: int, body: dict | None = None,
        anthropic: bool = False, open_access: bool = False) -> dict:
    op: dict[str, Any] = {"summary": summary, "tags": [tag],
                          "responses": {"200": ok, **_errors(401, 403, *errors,
                                                             anthropic=anthropic,
                                                             ollama=tag == "Ollama")}}
    if body is not None:
        op["requestBody"] = body
    if open_access:
        op["security"] = []
        op["responses"].pop("401")
    return op


# Lifecycle routes of DESIGN.md section 4; all answer 409 while a request runs.
LEVEL_SUMMARIES = {
    "/load": "Load the model (start the engine process); no-op when loaded",
    "/unload": "Unload: the engine process exits and every byte of VRAM is freed",
    "/sleep": "Sleep: free all weight, expert and KV VRAM; keep host copies and the process",
    "/wake": "Wake from sleep: copy weights back from pinned host memory",
    "/cache/release": "Release the MoE expert cache's VRAM (400 on a dense model)",
    "/cache/refill": "Refill the MoE expert cache",
    "/cache/shrink": "Shrink the MoE expert cache until keep_free_mib MiB are free; keeps serving",
    "/session/offload": "Offload the KV cache to host RAM (then disk); the next request restores",
}


def _paths() -> dict[str, Any]:
    stream_text = "The answer; text/event-stream when stream is true"
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _op(
            "OpenAI chat completion", "OpenAI", _ok("ChatCompletion", stream_text, stream=True),
            400, 503, body=_body("ChatCompletionRequest"))},
        "/v1/completions": {"post": _op(
            "OpenAI text completion", "OpenAI", _ok("Completion", stream_text, stream=True),
            400, 503, body=_body("CompletionRequest"))},
        "/completion": {"post": _op(
            "llama.cpp text completion (n_predict, n_probs)", "llama.cpp",
            _ok("LlamaCompletion", stream_text, stream=True), 400, 503,
            body=_body("LlamaCompletionRequest"))},
        "/infill": {"post": _op(
            "llama.cpp fill-in-the-middle (the model's FIM tokens; 400 without them)",
            "llama.cpp", _ok("LlamaCompletion", stream_text, stream=True), 400, 503,
            body=_body("LlamaInfillRequest"))},
        "/v1/models": {"get": _op("The served model and its status", "OpenAI",
                                  _ok("ModelList"))},
        "/v1/models/{model}": {"get": {**_op("One model", "OpenAI", _ok("Model"), 404),
                                       "parameters": [_path_param("model", "string")]}},
        "/v1/messages": {"post": _op(
            "Anthropic Messages", "Anthropic", _ok("Message", stream_text, stream=True),
            400, 503, body=_body("MessagesRequest"), anthropic=True)},
        "/v1/messages/count_tokens": {"post": _op(
            "Count a Messages request's prompt tokens", "Anthropic", _ok("TokenCount"), 400,
            body=_body("CountTokensRequest"), anthropic=True)},
        "/health": {"get": _op("Liveness; never wakes the model", "llama.cpp",
                               _ok("Health"), 503, open_access=True)},
        "/v1/health": {"get": _op("Liveness (alias of /health)", "llama.cpp", _ok("Health"),
                                  503, open_access=True)},
        "/apply-template": {"post": _op("The chat template applied to messages, no generation",
                                        "llama.cpp", _ok("Prompt"), 400,
                                        body=_body("ChatCompletionRequest"))},
        "/v1/chat/completions/input_tokens": {"post": _op(
            "Count a chat completion's prompt tokens (llama-server's)", "OpenAI",
            _ok("TokenCount"), 400, body=_body("ChatCompletionRequest"))},
        "/chat/completions/input_tokens": {"post": _op(
            "Alias of /v1/chat/completions/input_tokens", "OpenAI", _ok("TokenCount"), 400,
            body=_body("ChatCompletionRequest"))},
        "/chat/completions": {"post": _op(
            "Alias of /v1/chat/completions", "OpenAI",
            _ok("ChatCompletion", stream_text, stream=True), 400, 503,
            body=_body("ChatCompletionRequest"))},
        "/completions": {"post": _op(
            "llama.cpp's /completion, or /v1/completions for an OpenAI body (one naming a "
            "model or an OpenAI-only field)", "llama.cpp",
            _ok("LlamaCompletion", stream_text, stream=True), 400, 503,
            body=_body("LlamaCompletionRequest"))},
        "/models": {"get": _op("Alias of /v1/models", "OpenAI", _ok("ModelList"))},
        "/props": {"get": _op("Context size, chat template, is_sleeping", "llama.cpp",
                              _ok(None))},
        "/metrics": {"get": _op("Prometheus metrics", "llama.cpp", {
            "description": "Prometheus text format",
            "content": {"text/plain": {"schema": {"type": "string"}}}})},
        "/slots": {"get": _op("The KV cache slots", "llama.cpp", {
            "description": "One entry per slot",
            "content": {_JSON: {"schema": {"type": "array", "items": {"type": "object"}}}}})},
        "/tokenize": {"post": _op("Text to token ids (works while unloaded)", "llama.cpp",
                                  _ok("Tokens"), 400, body=_body("Tokenize"))},
        "/detokenize": {"post": _op("Token ids to text", "llama.cpp", _ok("Content"), 400,
                                    body=_body("Detokenize"))},
        "/v1/status": {"get": _op("Every level's state, bytes, timers and the engine process",
                                  "Control", _ok("Status"))},
        "/slots/{slot_id}": {"post": {
            **_op("Save, restore or erase a slot's KV cache (llama.cpp-compatible)", "Control",
                  _ok("ActionResult"), 400, 409, 500, 503, 507,
                  body=_body("SlotFile", required=False)),
            "parameters": [
                {**_path_param("slot_id", "integer"),
                 "schema": {"type": "integer", "minimum": 0, "maximum": NUM_CACHE_SLOTS - 1}},
                {"name": "action", "in": "query", "required": True,
                 "schema": {"enum": ["save", "restore", "erase"]}}]}},
        "/openapi.json": {"get": _op("This document", "Meta", _ok(None))},
    }
    paths.update(openapi_ollama.paths(_op, _ok, _body))
    paths.update(openapi_responses.paths(_op, _ok, _body))
    paths.update(openapi_embeddings.paths(_op, _ok, _body))
    for path, summary in LEVEL_SUMMARIES.items():
        paths[path] = {"post": _op(summary, "Control", _ok("ActionResult"), 400, 409, 503)}
    return paths


def _path_param(name: str, kind: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": kind}}


@functools.cache
def _document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "Strata", "version": __version__,
                 "description": "Local LLM server: OpenAI, Anthropic, Ollama and llama.cpp-style "
                 "routes, plus control routes that give VRAM back in stages."},
        "paths": _paths(),
        "components": {"schemas": {**SCHEMAS, **openapi_ollama.SCHEMAS,
                                       **openapi_responses.SCHEMAS,
                                       **openapi_embeddings.SCHEMAS}, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        # {} first: a key is needed only when the server was started with --api-key.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }


def openapi_document(server_url: str | None = None,
                     num_slots: int = NUM_CACHE_SLOTS) -> dict[str, Any]:
    """The OpenAPI 3.1 document; server_url (e.g. http://127.0.0.1:8080) fills `servers`,
    num_slots (the server's --slots) the slot ids' maximum."""
    document = copy.deepcopy(_document())
    if server_url:
        document["servers"] = [{"url": server_url}]
    _set_slot_maximum(document, num_slots - 1)
    return document


def _set_slot_maximum(node: Any, maximum: int) -> None:
    """Every slot id field and /slots/{slot_id} parameter gets this maximum."""
    if isinstance(node, list):
        for item in node:
            _set_slot_maximum(item, maximum)
    elif isinstance(node, dict):
        if node.get("name") == "slot_id" and isinstance(node.get("schema"), dict):
            node["schema"]["maximum"] = maximum
        for key, value in node.items():
            if key in _SLOT_FIELDS and isinstance(value, dict) and "maximum" in value:
                value["maximum"] = maximum
            _set_slot_maximum(value, maximum)


async def openapi_json(request: web.Request) -> web.Response:
    """GET /openapi.json."""
    num_slots = request.app[SERVICE_KEY].num_slots
    return web.json_response(openapi_document(f"{request.scheme}://{request.host}", num_slots))
