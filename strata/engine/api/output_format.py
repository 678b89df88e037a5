"""Structured-output fields of each dialect, and thinking switches, parsed into native values.

OpenAI: response_format (text, json_object, json_schema); the Responses API's text.format
(the same three, flattened); llama.cpp's json_schema and grammar (GBNF) fields; Anthropic:
output_config.format (and the beta's output_format) with type json_schema, and thinking
(enabled, disabled, adaptive). Each becomes a grammar for the engine.
"""

from __future__ import annotations

from typing import Any

from strata.engine.api.errors import bad_request
from strata.engine.api.grammar import gbnf_grammar, json_object_grammar, json_schema_grammar
from strata.engine.api.validation import MAX_INT_FIELD


def _only_one(body: dict, names: tuple[str, ...]) -> None:
    given = [n for n in names if body.get(n) is not None]
    if len(given) > 1:
        raise bad_request(f"{' and '.join(repr(n) for n in given)} both constrain the output; "
                          "send one of them", param=given[1])


def openai_output_grammar(body: dict) -> str | None:
    """The grammar of response_format / json_schema / grammar, or None for free text."""
    _only_one(body, ("response_format", "json_schema", "grammar"))
    if body.get("json_schema") is not None:
        return json_schema_grammar(body["json_schema"], "json_schema")
    if body.get("grammar") is not None:
        return gbnf_grammar(body["grammar"])
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        if fmt.get("schema") is not None:  # llama.cpp's extension: a schema with json_object
            return json_schema_grammar(fmt["schema"], "response_format.schema")
        return json_object_grammar("response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("'response_format.json_schema' must be an object with a "
                              "'schema'", param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("'response_format.json_schema.strict' must be true or false",
                              param="response_format")
        # strict or not, the schema is enforced: constrained decoding has no looser mode.
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise bad_request("'response_format' must have type 'text', 'json_object' or "
                      "'json_schema'", param="response_format")


_TEXT_FORMAT_KEYS = frozenset({"type", "name", "description", "schema", "strict"})


def responses_output_grammar(body: dict) -> tuple[str | None, dict[str, Any]]:
    """The Responses API's text.format ({type: text | json_object | json_schema, name, schema,
    strict}) as (grammar or None, the format to echo in the response's `text`)."""
    text = body.get("text")
    if text is None:
        text = {}
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object", param="text")
    for key in text:
        if key == "verbosity" and text[key] not in (None, "medium"):
            raise bad_request("'text.verbosity' other than 'medium' is not supported: a local "
                              "model has no verbosity setting", param="text.verbosity")
        if key not in ("format", "verbosity"):
            raise bad_request(f"'text.{key}' is not supported by Strata; leave it out",
                              param=f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request("'text.format' must have type 'text', 'json_object' or "
                          "'json_schema'", param="text.format")
    unknown = sorted(set(fmt) - _TEXT_FORMAT_KEYS)
    if unknown:
        raise bad_request(f"'text.format.{unknown[0]}' is not supported by Strata; leave it "
                          "out", param="text.format")
    if kind == "text":
        return None, {"type": "text"}
    if kind == "json_object":
        return json_object_grammar("text.format"), {"type": "json_object"}
    if "schema" not in fmt:
        raise bad_request("'text.format' of type 'json_schema' needs a 'schema'",
                          param="text.format")
    for key in ("name", "description"):
        if fmt.get(key) is not None and not isinstance(fmt[key], str):
            raise bad_request(f"'text.format.{key}' must be a string", param="text.format")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'text.format.strict' must be true or false", param="text.format")
    # strict or not, the schema is enforced: constrained decoding has no looser mode.
    return json_schema_grammar(fmt["schema"], "text.format.schema"), dict(fmt)


def anthropic_output_grammar(body: dict) -> str | None:
    """output_config.format (or the beta output_format): {type: json_schema, schema}."""
    _only_one(body, ("output_config", "output_format"))
    name, fmt = "output_format", body.get("output_format")
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise bad_request("'output_config' must be an object", param="output_config")
        for key in config:
            if key != "format" and config[key] is not None:
                raise bad_request(f"'output_config.{key}' is not supported by Strata; leave "
                                  "it out", param="output_config")
        name, fmt = "output_config.format", config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise bad_request(f"'{name}' must be {{'type': 'json_schema', 'schema': {{...}}}}",
                          param=name.split(".")[0])
    return json_schema_grammar(fmt["schema"], f"{name}.schema")


def openai_thinking(body: dict) -> bool | None:
    """enable_thinking (a top-level switch many servers take); None: the template's default."""
    value = body.get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise bad_request("'enable_thinking' must be true or false", param="enable_thinking")
    return value


def anthropic_thinking(body: dict, max_tokens: int | None) -> bool | None:
    """thinking: enabled (with budget_tokens under max_tokens), disabled, or adaptive."""
    thinking: Any = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return None
    if kind != "enabled":
        raise bad_request("'thinking' must have type 'enabled', 'disabled' or 'adaptive'",
                          param="thinking")
    budget = thinking.get("budget_tokens")
    if (isinstance(budget, bool) or not isinstance(budget, int)
            or not 1024 <= budget <= MAX_INT_FIELD):
        raise bad_request("'thinking.budget_tokens' must be an integer of at least 1024",
                          param="thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise bad_request("'thinking.budget_tokens' must be less than 'max_tokens'",
                          param="thinking")
    if thinking.get("display") not in (None, "summarized"):
        raise bad_request("'thinking.display' other than 'summarized' is not supported",
                          param="thinking")
    return True
