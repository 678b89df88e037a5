"""Check a status dict against status_schema's TypedDicts: exact keys, value types.

A TypedDict demands exactly its keys (none missing, none extra); `X | None`, dict[str, X],
list[X] and Any are followed; an int passes for float (JSON and Python both allow it), a bool
never passes for int.
"""

from __future__ import annotations

import types
import typing
from typing import Any, get_args, get_origin, get_type_hints, is_typeddict


def shape_problems(value: Any, hint: Any, where: str = "status") -> list[str]:
    """Every way `value` differs from the type `hint`, as "where: what" lines; [] when none."""
    if hint is Any:
        return []
    if is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a dict"]
        hints = get_type_hints(hint)
        problems = [f"{where}: missing key {key!r}" for key in hints if key not in value]
        problems += [f"{where}: extra key {key!r}" for key in value if key not in hints]
        for key, key_hint in hints.items():
            if key in value:
                problems += shape_problems(value[key], key_hint, f"{where}.{key}")
        return problems
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [shape_problems(value, option, where) for option in get_args(hint)]
        return [] if any(not p for p in options) else min(options, key=len)
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a dict"]
        key_hint, value_hint = get_args(hint)
        return [p for k, v in value.items() for p in
                shape_problems(k, key_hint, f"{where} key") + shape_problems(v, value_hint,
                                                                             f"{where}[{k!r}]")]
    if origin is list:
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        (item_hint,) = get_args(hint)
        return [p for i, v in enumerate(value) for p in shape_problems(v, item_hint,
                                                                       f"{where}[{i}]")]
    if hint is type(None):
        return [] if value is None else [f"{where}: {value!r} is not None"]
    allowed = (int, float) if hint is float else (hint,)
    if (isinstance(value, bool) and hint is not bool) or not isinstance(value, allowed):
        return [f"{where}: {value!r} is {type(value).__name__}, not {hint.__name__}"]
    return []
