"""Ollama request bodies (`/api/chat`, `/api/generate`) parsed into Strata's native params.

Ollama's `options` object mixes sampling knobs with load-time ones (num_gpu, use_mmap, ...).
Strata honours the sampling knobs it implements and refuses every other key with a 400 that
names it, so an app never believes a setting took effect when it did not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from strata.engine.api import validation as v
from strata.engine.api.errors import bad_request
from strata.engine.api.params import GenerationParams
from strata.engine.api.sampling_params import parse_penalties

OLLAMA_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
# Ollama option -> what Strata does with it (documented in docs/api.md).
SUPPORTED_OPTIONS = frozenset({"num_predict", "temperature", "top_k", "top_p", "min_p", "seed",
                               "stop", "num_ctx", "repeat_penalty", "repeat_last_n",
                               "presence_penalty", "frequency_penalty"})
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
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
    """Ollama's keep_alive: seconds as a number, or a Go duration string ("5m", "1h30m", "-1")."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            return sign * float(body)
        except ValueError:
            pass
        parts = _DURATION_PART.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            return sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    raise bad_request(f"'keep_alive' is {value!r}; use seconds or a duration such as '5m', "
                      "'1h', '0' (unload when done) or '-1' (keep loaded)", param="keep_alive")


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
    for name in ("tools", "images", *refuse):
        if body.get(name) not in (None, "", [], {}, False):
            raise bad_request(f"{name!r} is not supported by Strata's Ollama API yet; "
                              "send the request without it", param=name)
    if body.get("think") not in (None, False):
        raise bad_request("'think' is not supported: this server does not split reasoning "
                          "out yet; send think=false or leave it out", param="think")
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


def parse_ollama_messages(body: dict) -> list[dict[str, str]]:
    """/api/chat messages; images and tool calls are refused by name until Strata has them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'",
                              param="messages")
        for name in ("images", "tool_calls"):
            if message.get(name):
                raise bad_request(f"messages[{i}] has {name!r}, which Strata does not "
                                  "support yet", param="messages")
        role, content = message.get("role"), message.get("content", "")
        if role not in OLLAMA_ROLES:
            raise bad_request(f"messages[{i}] has unknown role {role!r}; use one of "
                              f"{', '.join(OLLAMA_ROLES)}", param="messages")
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string", param="messages")
        parsed.append({"role": OLLAMA_ROLES[role], "content": content})
    return parsed
