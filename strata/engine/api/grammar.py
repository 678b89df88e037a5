"""Output grammars of a request, compiled on the host into llguidance's grammar format.

JSON schemas (response_format, Anthropic's output_config.format, llama.cpp's json_schema),
llama.cpp's GBNF `grammar` and the forced tool calls of tool_choice all become one llguidance
grammar string, which travels in SamplingSpec.grammar to the engine that enforces it. Each is
validated here first, so a schema feature llguidance cannot enforce is a 400 naming it before
anything runs (llguidance reports such keywords as "Unimplemented keys").

Why llguidance: no dependencies (one abi3 wheel), schema keywords it cannot enforce are errors
instead of being dropped, GBNF and Lark grammars with embedded JSON schemas (which forced tool
calls need), and it is what llama.cpp uses. Measured per-token mask cost in docs/api.md.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from strata.engine.api.errors import bad_request

if TYPE_CHECKING:  # only in llguidance's stubs
    from llguidance._lib import JsonCompileOptions

# Compact JSON: flexible whitespace lets a small model emit newlines until max_tokens.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                     "key_separator": ": "}
_ANY_JSON_OBJECT = {"type": "object"}
# Keywords whose value is one subschema, or a list or a map of them: where closed_objects walks.
_ONE_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "not", "if",
                  "then", "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
# Beside these, an object's keys come from more than its own `properties`.
_ADDS_KEYS = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas",
              "additionalProperties", "unevaluatedProperties")


def _checked(grammar: str, param: str, what: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = messages[0].strip().splitlines()[0] if messages else "unknown error"
        reason = re.sub(r"^at \d+\(\d+\): ", "", reason)
        raise bad_request(f"{what} cannot be enforced by constrained decoding: {reason}; "
                          "remove that feature", param=param)
    return grammar


def closed_objects(schema: Any, param: str) -> Any:
    """schema (a copy) with `additionalProperties: false` on every object schema that lists
    `properties` and says nothing about other keys, as llama.cpp and Ollama read schemas:
    pydantic, LangChain's @tool and `llm --schema` leave it out, and an open object lets a
    small model add keys until max_tokens. llguidance follows JSON Schema (open by default)
    and has no option for this, so the schema is rewritten. The members of an allOf of
    several, and objects beside an allOf/anyOf/oneOf/$ref/if (which may add keys), are left
    open: closing them would refuse the keys the other schemas add."""
    try:
        return _closed(schema)
    except RecursionError:
        raise bad_request(f"the JSON schema in '{param}' is nested too deeply",
                          param=param) from None


def _closed(schema: Any, *, is_closable: bool = True) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s) for s in out[key]]
    all_of = out.get("allOf")
    if isinstance(all_of, list):
        out["allOf"] = [_closed(s, is_closable=len(all_of) == 1) for s in all_of]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(s) for name, s in out[key].items()}
    if (is_closable and isinstance(out.get("properties"), dict)
            and not any(key in out for key in _ADDS_KEYS)):
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON text valid against schema (objects closed: closed_objects); 400
    naming what cannot be enforced."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema, param),
                                                                overrides=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise bad_request(f"'{param}' is not a usable JSON schema: {exc}", param=param) from None
    return _checked(grammar, param, f"the JSON schema in '{param}'")


def json_object_grammar(param: str) -> str:
    """Any JSON object (response_format json_object)."""
    return json_schema_grammar(_ANY_JSON_OBJECT, param)


def gbnf_grammar(text: Any, param: str = "grammar") -> str:
    """llama.cpp's GBNF (or a Lark grammar) as an llguidance grammar."""
    if not isinstance(text, str) or not text.strip():
        raise bad_request(f"'{param}' must be a non-empty GBNF grammar string", param=param)
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on bad GBNF
        raise bad_request(f"'{param}' is not a valid GBNF grammar: {exc}", param=param) from None
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param, f"the grammar '{param}'")


def lark_grammar(lark: str, param: str, what: str) -> str:
    """A Lark grammar we wrote (e.g. a tool-call format with %json schemas), validated."""
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), param, what)


def lark_literal(text: str) -> str:
    """text as a Lark string literal."""
    return json.dumps(text)


def lark_json(schema: dict, param: str) -> str:
    """An inline JSON value of schema (objects closed: closed_objects), in llguidance's Lark
    dialect (compact separators)."""
    return "%json " + json.dumps({**closed_objects(schema, param), "x-guidance": _JSON_OPTIONS})
