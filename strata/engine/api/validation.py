"""Parse JSON request bodies into native values early, with one-line 400s on bad input."""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from strata.engine.api.errors import bad_request

NUM_CACHE_SLOTS = 4
MAX_STOP_STRINGS = 4
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


async def read_json_object(request: web.Request, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a JSON object; {} for an empty body when allow_empty."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise bad_request("request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError
        raise bad_request(f"request body is not valid JSON ({_first_line(exc)}); "
                          "send a JSON object") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {_json_type(body)}")
    return body


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def get_int(body: dict, name: str, default: int | None = None, *, minimum: int | None = None,
            maximum: int | None = None) -> int | None:
    """An optional integer field (JSON null means absent); booleans are refused."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value = int(value)  # some clients send 256.0
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {_json_type(value)}", param=name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' is {value}; it must be at least {minimum}", param=name)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{name}' is {value}; it must be at most {maximum}", param=name)
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


def get_cache_slot(body: dict) -> int:
    """strata_cache_slot (alias id_slot): which of the server's KV cache slots to use."""
    name = "strata_cache_slot" if body.get("strata_cache_slot") is not None else "id_slot"
    return get_int(body, name, 0, minimum=0, maximum=NUM_CACHE_SLOTS - 1)


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
