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


def _checked(grammar: str, param: str, what: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = messages[0].strip().splitlines()[0] if messages else "unknown error"
        reason = re.sub(r"^at \d+\(\d+\): ", "", reason)
        raise bad_request(f"{what} cannot be enforced by constrained decoding: {reason}; "
                          "remove that feature", param=param)
    return grammar


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON text valid against schema; 400 naming what cannot be enforced."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
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


def lark_json(schema: dict) -> str:
    """An inline JSON value of schema, in llguidance's Lark dialect (compact separators)."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
