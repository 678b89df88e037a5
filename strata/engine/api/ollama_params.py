"""Ollama request bodies (`/api/chat`, `/api/generate`) parsed into Strata's native params.

Ollama's `options` object mixes sampling knobs with load-time ones (num_gpu, use_mmap, ...).
Strata honours the sampling knobs it implements and refuses every other key with a 400 that
names it, so an app never believes a setting took effect when it did not.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from strata.engine.api import validation as v
from strata.engine.api.chat_messages import call_arguments, tool_call
from strata.engine.api.errors import bad_request
from strata.engine.api.params import GenerationParams
from strata.engine.api.reasoning_effort import ollama_think
from strata.engine.api.sampling_params import parse_penalties

OLLAMA_ROLES = ("system", "user", "assistant", "tool")
# Ollama option -> what Strata does with it (documented in docs/api.md).
SUPPORTED_OPTIONS = frozenset({"num_predict", "temperature", "top_k", "top_p", "min_p", "seed",
                               "stop", "num_ctx", "repeat_penalty", "repeat_last_n",
                               "presence_penalty", "frequency_penalty"})
MAX_KEEP_ALIVE_S = 1e9  # about 31 years; "-1" keeps the model loaded for good
_PLAIN_NUMBER = re.compile(r"\d{1,12}(?:\.\d{1,12})?")
_DURATION_PART = re.compile(r"(\d{1,12}(?:\.\d{1,12})?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class OllamaRequest:
    """An Ollama generation request: Strata's params plus Ollama's own fields."""

    params: GenerationParams
    model: str
    keep_alive_s: float | None  # None: not given; < 0: forever; 0: unload when done
    context_tokens: int | None  # num_ctx, when the request caps the context
    grammar: str | None = None  # `format`: JSON or a JSON schema, by constrained decoding


def _format_grammar(value: object) -> str | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema; enforced, never hinted."""
    from strata.engine.api.grammar import json_object_grammar, json_schema_grammar

    if value in (None, ""):
        return None
    if value == "json":
        return json_object_grammar("format")
    if isinstance(value, dict):
        return json_schema_grammar(value, "format")
    raise bad_request("'format' must be \"json\" or a JSON schema object", param="format")


def parse_keep_alive(value: object) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration string ("5m", "1h30m", "-1");
    finite and at most MAX_KEEP_ALIVE_S ("NaN" once unloaded the model after every request)."""
    if value is None:
        return None
    seconds = _keep_alive_s(value)
    if seconds is None or not math.isfinite(seconds) or seconds > MAX_KEEP_ALIVE_S:
        raise bad_request(f"'keep_alive' is {value!r:.40}; use seconds (at most "
                          f"{MAX_KEEP_ALIVE_S:.0e}) or a duration such as '5m', '1h', '0' "
                          "(unload when done) or '-1' (keep loaded)", param="keep_alive")
    return seconds


def _keep_alive_s(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) if abs(value) <= MAX_KEEP_ALIVE_S else math.inf
    if not isinstance(value, str):
        return None
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if _PLAIN_NUMBER.fullmatch(body):  # float() alone would take 'nan', 'inf', '1e400'
        return sign * float(body)
    parts = _DURATION_PART.findall(body)
    if parts and "".join(n + u for n, u in parts) == body:
        return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    return None


def _options(body: dict) -> dict:
    options = v.get_object(body, "options")
    unsupported = sorted(set(options) - SUPPORTED_OPTIONS)
    if unsupported:
        raise bad_request(f"options {', '.join(map(repr, unsupported))} are not supported by "
                          f"Strata; supported: {', '.join(sorted(SUPPORTED_OPTIONS))}",
                          param="options")
    return options


def _max_tokens(options: dict) -> int | None:
    # Ollama: -1 generates until the end of the context, -2 until it is full: both are ours.
    num_predict = v.get_int(options, "num_predict", None, minimum=-2)
    if num_predict is None or num_predict < 0:
        return None
    if num_predict == 0:
        raise bad_request("'num_predict' is 0; ask for at least one token", param="num_predict")
    return num_predict


def _stops(options: dict) -> tuple[str, ...]:
    stop = options.get("stop")
    if isinstance(stop, str):  # Ollama's Modelfile form allows one string
        options = {**options, "stop": [stop]}
    return v.get_stop_strings(options, "stop")


def parse_ollama(body: dict, *, refuse: tuple[str, ...] = ()) -> OllamaRequest:
    """The common fields of /api/chat and /api/generate; `refuse` names fields this route
    does not honour, each a 400 when present with a non-empty value."""
    for name in ("images", *refuse):
        if body.get(name) not in (None, "", [], {}, False):
            raise bad_request(f"{name!r} is not supported by Strata's Ollama API; "
                              "send the request without it", param=name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required; GET /api/tags lists the models",
                          param="model")
    options = _options(body)
    params = GenerationParams(
        max_tokens=_max_tokens(options),
        temperature=v.get_temperature(options, maximum=2.0), top_p=v.get_top_p(options),
        top_k=v.get_top_k(options), min_p=v.get_min_p(options), seed=v.get_seed(options),
        stops=_stops(options), is_stream=v.get_bool(body, "stream", True),
        include_usage=True, **v.get_cache_slot(body), penalties=parse_penalties(options))
    return OllamaRequest(params=params, model=model,
                         keep_alive_s=parse_keep_alive(body.get("keep_alive")),
                         context_tokens=v.get_int(options, "num_ctx", None, minimum=1),
                         grammar=_format_grammar(body.get("format")))


def parse_ollama_think(body: dict) -> tuple[bool | None, str | None]:
    """`think`: (thinking, effort). true or false turns a thinking model's reasoning on or
    off (it comes back as message.thinking); "low" | "medium" | "high" is a reasoning effort,
    for a template that takes one (gpt-oss); None leaves the template's default."""
    return ollama_think(body)


def _tool_calls(message: dict, where: str, index: int) -> list[dict[str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{j}] needs a function with a name",
                              param="messages")
        call_id = str(call.get("id") or f"call_{index}_{j}")
        out.append(tool_call(call_id, function["name"], call_arguments(
            function.get("arguments", {}), f"{where}.tool_calls[{j}]", is_lenient=False)))
    return out


def parse_ollama_messages(body: dict) -> list[dict[str, Any]]:
    """/api/chat messages in the form chat templates read: assistant `tool_calls` (arguments
    an object, as Ollama sends them) and `thinking`, `tool` results matched to the call they
    answer (by tool_call_id, else the first unanswered call of that tool_name). Images are a
    400 naming the field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    parsed: list[dict[str, Any]] = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name), oldest first
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'",
                              param="messages")
        if message.get("images"):
            raise bad_request(f"{where} has 'images', which Strata does not support: it "
                              "serves text models", param="messages")
        role, content = message.get("role"), message.get("content")
        if role not in OLLAMA_ROLES:
            raise bad_request(f"{where} has unknown role {role!r}; use one of "
                              f"{', '.join(OLLAMA_ROLES)}", param="messages")
        if content is not None and not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string", param="messages")
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant":
            calls = _tool_calls(message, where, i)
            if calls:
                out["tool_calls"] = calls
                unanswered += [(c["id"], c["function"]["name"]) for c in calls]
            if isinstance(message.get("thinking"), str) and message["thinking"]:
                out["reasoning_content"] = message["thinking"]
        elif role == "tool":
            out["tool_call_id"], out["name"] = _answered_call(message, unanswered, i)
        parsed.append(out)
    return parsed


def _answered_call(message: dict, unanswered: list[tuple[str, str]], index: int
                   ) -> tuple[str, str]:
    """(call id, tool name) a tool message answers; taken off the unanswered list."""
    name = message.get("tool_name") or message.get("name")
    call_id = message.get("tool_call_id")
    for pending in unanswered:
        if pending[0] == call_id or (call_id is None and name in (None, pending[1])):
            unanswered.remove(pending)
            return pending
    return str(call_id or f"call_{index}"), str(name or "")
