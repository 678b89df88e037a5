"""The TOML config file: the one reader (for `strata serve` and the tray alike) and the writer
(the tray's Settings window).

tomllib only reads, so this writes TOML itself: scalar and list keys at the top, then tables
and arrays of tables (`[[rules]]`). Writes go to a temp file and are renamed into place.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strata.engine.service.settings_kinds import SettingsError


class ConfigFileError(SettingsError):
    """The config file cannot be read or written; the message says which and how to fix it."""


def read_config(path: Path, *, must_exist: bool = False) -> dict[str, Any]:
    """The parsed config file; {} when it does not exist yet, unless must_exist (a file named
    on the command line)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        if must_exist:
            raise ConfigFileError(f"config file {path} does not exist; create it or drop "
                                  "--config") from None
        return {}
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(
            f"config file {path} is not valid TOML ({exc}); fix or delete it"
        ) from None


def _key(name: str) -> str:
    # bare keys are ASCII letters, digits, - and _ only (str.isalnum would let "²" through)
    bare = name and all(c.isascii() and (c.isalnum() or c in "-_") for c in name)
    return name if bare else _string(name)


def _string(text: str) -> str:
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return ("-" if value < 0 else "") + ("nan" if math.isnan(value) else "inf")
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v, where) for v in value) + "]"
    raise ConfigFileError(f"config key {where}: cannot write a {type(value).__name__} to TOML")


def _is_table_array(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, Mapping) for v in value)
    )


def _emit(table: Mapping[str, Any], prefix: str, lines: list[str]) -> None:
    nested = []
    for name, value in table.items():
        if value is None:
            continue  # TOML has no null: an unset key is simply absent
        if isinstance(value, Mapping) or _is_table_array(value):
            nested.append((name, value))
        else:
            lines.append(f"{_key(name)} = {_value(value, prefix + name)}")
    for name, value in nested:
        path = f"{prefix}{_key(name)}"
        if isinstance(value, Mapping):
            lines += ["", f"[{path}]"]
            _emit(value, path + ".", lines)
        else:
            for item in value:
                lines += ["", f"[[{path}]]"]
                _emit(item, path + ".", lines)


def dumps(config: Mapping[str, Any]) -> str:
    """TOML text for a dict of scalars, lists, tables and arrays of tables."""
    lines: list[str] = []
    _emit(config, "", lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def write_config(path: Path, config: Mapping[str, Any]) -> None:
    """Write config to path atomically (temp file, fsync, rename)."""
    text = dumps(config)
    tomllib.loads(text)  # never leave a file behind that `strata serve` could not read
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.replace(path)
    except OSError as exc:
        raise ConfigFileError(
            f"could not write config file {path}: {exc.strerror}; "
            "check the folder exists and is writable"
        ) from exc
