"""Parse JSON request bodies into native values early, with one-line 400s on bad input."""

from __future__ import annotations

import json
import math
import re
from typing import Any, overload

from aiohttp import web

from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.protocol import slot_problem

_MAX_SLOT_DIGITS = 6  # more digits than any slot count needs; int() of 4,301 digits raises
MAX_STOP_STRINGS = 4
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# The bound of an integer field that states none: past any count of tokens, slots or MiB,
# and what the engine's int32/int64 tensors and the protocol carry without overflow.
MAX_INT_FIELD = 2**31 - 1
# Token ids and counts written as decimal strings: int() of 4,301 digits raises ValueError.
MAX_ID_DIGITS = 10


_INLINE_PARSE_BYTES = 64 * 1024  # smaller bodies parse on the loop: quicker than a hand-off
# Deeper than any real request (tool schemas nest a few dozen levels at most); deeper bodies
# would hit Python's recursion limit in whatever walks them later (templates, json.dumps).
MAX_JSON_DEPTH = 64
_BODY_KEY = web.RequestKey("strata_json_body", object)  # the parse's outcome, read once


async def read_json_object(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a JSON object; {} for an empty body when allow_empty.

    THE body parser: every route and the model-routing middleware read the body through it,
    so bad JSON, nesting past MAX_JSON_DEPTH, non-finite numbers and non-object bodies are
    the same 400 everywhere, and the body is parsed once. Large bodies are parsed on the app's
    worker threads, off the event loop.
    """
    body = await _parsed_body(request)
    if body is None:
        if allow_empty:
            return {}
        raise bad_request("request body is empty; send a JSON object")
    return body


async def optional_json_object(request: web.Request) -> dict[str, Any] | None:
    """The body as a JSON object, None when it is empty (a 400 when it is not an object)."""
    return await _parsed_body(request)


async def _parsed_body(request: web.Request) -> dict[str, Any] | None:
    if _BODY_KEY not in request:
        try:
            request[_BODY_KEY] = await _parse_body(request)
        except ApiError as exc:
            request[_BODY_KEY] = exc
    outcome = request[_BODY_KEY]
    if isinstance(outcome, ApiError):
        raise outcome
    return outcome  # type: ignore[return-value]  # a dict or None, as _parse_body returns


async def _parse_body(request: web.Request) -> dict[str, Any] | None:
    raw = await request.read()  # past the app's client_max_size: 413 (errors.py)
    if not raw.strip():
        return None
    if len(raw) <= _INLINE_PARSE_BYTES:
        return parse_json_object(raw)
    return await run_cpu(request.app, parse_json_object, raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object of valid Unicode text and finite numbers, nested at
    most MAX_JSON_DEPTH deep, else a one-line 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int past 4,300 digits
        if not isinstance(exc, json.JSONDecodeError) and "digits" in str(exc):
            # Parse again with such integers as infinity, so the check below names the field.
            body = json.loads(raw, parse_int=_bounded_int)
        else:
            raise bad_request(f"request body is not valid JSON ({_first_line(exc)}); "
                              "send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {_json_type(body)}")
    check_json_values(body)
    return body


def _bounded_int(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:  # past sys.get_int_max_str_digits()
        return math.inf


def _too_deep() -> ApiError:
    return bad_request(f"request body is nested more than {MAX_JSON_DEPTH} levels deep; "
                       "send a flatter JSON object", code="too_deep")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_values(value: Any) -> None:
    """400 for what JSON parsers let through but no field can use: nesting past
    MAX_JSON_DEPTH, a lone UTF-16 surrogate (\\ud800 escapes decode to one, which is no
    Unicode text: the tokenizer and UTF-8 encoding would fail deep inside), and NaN,
    Infinity or numbers too big for a float (1e400), each named by its path."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:  # iterative: a deeply nested body must not hit the recursion limit
        path, item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise _surrogate_error(path or "body")
        elif isinstance(item, float):
            if not math.isfinite(item):
                where = path or "body"
                raise bad_request(f"'{where}' is {item} (NaN, Infinity or a number too big for "
                                  "a float); send a finite number", param=_field(where),
                                  code="invalid_number")
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _SURROGATE.search(key):
                    raise _surrogate_error(f"{path}.{key!r}" if path else "body")
                stack.append((f"{path}.{key}" if path else key, child, depth + 1))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child, depth + 1)
                         for i, child in reversed(list(enumerate(item))))


def _field(where: str) -> str:
    return where.split("[")[0].split(".")[0]


def _surrogate_error(where: str) -> ApiError:
    return bad_request(f"'{where}' contains a lone UTF-16 surrogate escape (such as \\ud800) "
                      "that is not valid Unicode; send valid text", param=_field(where),
                      code="invalid_unicode")


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


@overload  # with an int default the value is never None
def get_int(body: dict, name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int: ...
@overload
def get_int(body: dict, name: str, default: None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int | None: ...
def get_int(body: dict, name: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int | None:
    """An optional integer field (JSON null means absent); booleans are refused. Without a
    maximum it is MAX_INT_FIELD: every number a request carries is bounded."""
    value = body.get(name)
    if value is None:
        return default
    maximum = MAX_INT_FIELD if maximum is None else maximum
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)  # some clients send 256.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {_json_type(value)}", param=name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' is {value}; it must be at least {minimum}", param=name)
    if value > maximum:
        raise bad_request(f"'{name}' is {value:.6g}; it must be at most {maximum}", param=name)
    return value


def get_float(body: dict, name: str, default: float, *, minimum: float, maximum: float,
              exclusive_minimum: bool = False) -> float:
    """An optional finite number within [minimum, maximum] (or (minimum, maximum])."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {_json_type(value)}", param=name)
    low_ok = value > minimum if exclusive_minimum else value >= minimum
    if not low_ok or value > maximum:
        bracket = "(" if exclusive_minimum else "["
        raise bad_request(f"'{name}' is {value}; it must be in {bracket}{minimum}, {maximum}]",
                          param=name)
    return float(value)


def parse_id_string(text: str) -> int | None:
    """A non-negative integer written in ASCII digits ("50256"), else None (int() alone takes
    '²', full-width digits, '+5' and raises on 4,301 digits)."""
    if text.isascii() and text.isdigit() and len(text) <= MAX_ID_DIGITS:
        return int(text)
    return None


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    """An optional boolean field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {_json_type(value)}", param=name)
    return value


def get_object(body: dict, name: str) -> dict:
    """An optional JSON object field ({} when absent)."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, got {_json_type(value)}", param=name)
    return value


def get_seed(body: dict) -> int | None:
    """The optional sampling seed, within the range the engine's generator takes."""
    return get_int(body, "seed", None, minimum=_SEED_MIN, maximum=_SEED_MAX)


def get_stop_strings(body: dict, name: str, *, max_count: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    """Stop strings given as one string or a list of non-empty strings."""
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"'{name}' must be a string or a list of strings", param=name)
    if len(items) > max_count:
        raise bad_request(f"'{name}' has {len(items)} entries; at most {max_count} are allowed",
                          param=name)
    if any(s == "" for s in items):
        raise bad_request(f"'{name}' contains an empty string; remove it", param=name)
    return tuple(dict.fromkeys(items))


def parse_slot(value: Any, param: str, num_slots: int) -> int:
    """A cache slot number from a JSON integer or a URL path segment, else a 400 naming param.

    The one slot validator of every route, against the server's configured slots (--slots):
    only ASCII digits count in a path ('²', Arabic-Indic or full-width digits are refused,
    though str.isdigit() and int() take them).
    """
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit() and len(value) <= _MAX_SLOT_DIGITS
                and slot_problem(int(value), num_slots) is None):
            raise bad_request(f"slot {value[:20]!r} does not exist; slots are "
                              f"0..{num_slots - 1}", param=param)
        return int(value)
    value = _slot_integer(value, param)
    check_slot(value, param, num_slots)
    return value


def check_slot(slot: int, param: str, num_slots: int) -> None:
    """A 400 naming param when slot is not one of the server's 0..num_slots-1."""
    if slot_problem(slot, num_slots):
        raise bad_request(f"'{param}' is {slot}; slots are 0..{num_slots - 1} (--slots)",
                          param=param)


def _slot_integer(value: Any, param: str) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # some clients send 1.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{param}' must be an integer, got {_json_type(value)}", param=param)
    return value


def get_cache_slot(body: dict) -> dict[str, Any]:
    """strata_cache_slot (alias id_slot): {"slot", "slot_param"} for GenerationParams.

    slot None (the field left out, or llama.cpp's id_slot -1) lets the engine pick the slot
    sharing the longest prefix with the prompt. The range is checked against the server's
    slots when the generation starts (textgen), where the configured count is known.
    """
    name = "strata_cache_slot" if body.get("strata_cache_slot") is not None else "id_slot"
    value = body.get(name)
    if value is None:
        return {"slot": None, "slot_param": name}
    if isinstance(value, str):  # a JSON body carries numbers, not digit strings
        raise bad_request(f"'{name}' must be an integer, got a string", param=name)
    value = _slot_integer(value, name)
    if value == -1 and name == "id_slot":  # llama.cpp's "any slot"
        return {"slot": None, "slot_param": name}
    if value < 0:
        raise bad_request(f"'{name}' is {value}; slots are 0..N-1 (--slots N)", param=name)
    return {"slot": value, "slot_param": name}


def get_temperature(body: dict, *, maximum: float) -> float | None:
    """Sampling temperature; None when absent: the server's default (SamplingDefaults)."""
    return _optional(body, "temperature", minimum=0.0, maximum=maximum)


def get_top_p(body: dict) -> float | None:
    return _optional(body, "top_p", minimum=0.0, maximum=1.0, exclusive_minimum=True)


def get_top_k(body: dict) -> int | None:
    return get_int(body, "top_k", None, minimum=0)


def get_min_p(body: dict) -> float | None:
    return _optional(body, "min_p", minimum=0.0, maximum=1.0)


def _optional(body: dict, name: str, **limits: Any) -> float | None:
    if body.get(name) is None:
        return None
    return get_float(body, name, 0.0, **limits)
