"""The kinds of value a setting can hold: how each is checked, read from a flag and from text.

One kind per shape (an integer in a range, seconds, a byte size, a list of host names, ...),
so the schema in settings.py says only which kind a setting is; every message names the
setting and what it accepts, in one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.engine.core.engine_config import parse_expert_cache
from strata.errors import StrataError


class SettingsError(StrataError, ValueError):
    """A setting with a wrong name, type or value; the message names it and says what to do."""


def type_error(name: str, expected: str, value: Any) -> SettingsError:
    return SettingsError(f"{name!r} must be {expected}, got {value!r} ({type(value).__name__})")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_bytes(text: str | int) -> int:
    """A byte count from an int or a string like '512MiB', '4 GiB', '2GB' or '1024'."""
    if is_int(text):
        return int(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 4GiB, 512MiB or a number of bytes")
    number, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if prefix and not binary and str(text).strip()[-1:] in "bB" else 1024
    return int(float(number) * base**power)


class Kind:
    """A setting's shape. check() validates and normalizes a value from a file, a flag or code;
    from_flag() turns a flag's text into the value check() takes (ValueError: not parseable)."""

    # A value a config file may hold, other than the default (tests set every key with it).
    sample: Any = None

    @property
    def metavar(self) -> str | None:
        """The flag's value in --help; read-only, so a kind may compute it from its fields."""
        return None

    def check(self, name: str, value: Any) -> Any:
        raise NotImplementedError

    def from_flag(self, text: str) -> Any:
        return text

    def from_env(self, name: str, text: str) -> Any:
        return self.check(name, self.from_flag(text))

    def to_engine(self, value: Any) -> Any:
        """The value as its EngineConfig field takes it."""
        return value


@dataclass(frozen=True)
class Text(Kind):
    """A non-empty string; None when unset. path: "file" or "dir" for a path ('~' expands);
    is_secret: never shown (a password field in the tray)."""

    path: str | None = None
    is_secret: bool = False
    metavar: str | None = None
    sample: Any = "/tmp/x"

    @property
    def is_path(self) -> bool:
        return self.path is not None

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise type_error(name, "a non-empty string", value)
        return os.path.expanduser(value) if self.is_path else value


@dataclass(frozen=True)
class ModelName(Kind):
    """A model's name as clients send it: non-empty, no white space; None when unset."""

    metavar: str | None = "NAME"
    sample: Any = "my-model"

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
            raise type_error(name, "a model name without spaces", value)
        return value


@dataclass(frozen=True)
class HostAddress(Kind):
    """The address to bind: a host name or address, or several separated by commas; never
    empty."""

    metavar: str | None = "ADDR"
    sample: Any = "0.0.0.0"

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, str) or not all(part.strip() for part in value.split(",")):
            raise type_error(name, "a host name or address (several: comma-separated)", value)
        return value


@dataclass(frozen=True)
class Integer(Kind):
    """An int in low..high (high None: no upper limit)."""

    low: int = 0
    high: int | None = None
    metavar: str | None = "N"
    sample: Any = 1

    def check(self, name: str, value: Any) -> Any:
        if not is_int(value):
            raise type_error(name, "an integer", value)
        if value < self.low or (self.high is not None and value > self.high):
            limit = f">= {self.low}" if self.high is None else f"{self.low}..{self.high}"
            raise SettingsError(f"{name!r} must be {limit}, got {value}")
        return value

    def from_flag(self, text: str) -> Any:
        return int(text)


@dataclass(frozen=True)
class Seconds(Kind):
    """A number of seconds >= 0, as a float. is_timer: an idle timer, where 0 (or None) means
    off, so a flag can turn off a timer that the config file sets."""

    is_timer: bool = False
    metavar: str | None = "S"
    sample: Any = 30.0

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.is_timer:
            return None
        if not is_number(value):
            raise type_error(name, "a number of seconds", value)
        if value < 0:
            raise SettingsError(f"{name!r} must be >= 0 seconds, got {value}")
        return None if self.is_timer and value == 0 else float(value)

    def from_flag(self, text: str) -> Any:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number of seconds") from None


@dataclass(frozen=True)
class Size(Kind):
    """A byte count >= 0, from a number of bytes or a size such as 4GiB."""

    metavar: str | None = "SIZE"
    sample: Any = "1GiB"

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            raise type_error(name, "a size such as 4GiB or a number of bytes", value)
        try:
            size_bytes = parse_bytes(value)
        except ValueError as exc:
            raise SettingsError(f"{name!r}: {exc}") from None
        if size_bytes < 0:
            raise SettingsError(f"{name!r} must be >= 0 bytes, got {value}")
        return size_bytes

    def from_flag(self, text: str) -> Any:
        return parse_bytes(text)


@dataclass(frozen=True)
class Boolean(Kind):
    """true or false; its flag comes as --name / --no-name."""

    sample: Any = True

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool):
            raise type_error(name, "true or false", value)
        return value

    def from_env(self, name: str, text: str) -> Any:
        # Environment switches are 0 or 1, as docs/configuration.md lists them.
        if text not in ("0", "1"):
            raise SettingsError(f"{name} must be 0 or 1, got {text!r}")
        return text == "1"


@dataclass(frozen=True)
class Switch(Boolean):
    """true, false or None (unset: the engine decides)."""

    def check(self, name: str, value: Any) -> Any:
        return None if value is None else super().check(name, value)


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few words."""

    options: tuple[str, ...] = ()

    @property
    def metavar(self) -> str | None:
        return "|".join(self.options)

    @property
    def sample(self) -> Any:
        return self.options[-1]

    def check(self, name: str, value: Any) -> Any:
        if value not in self.options:
            raise SettingsError(f"{name!r} must be one of {', '.join(self.options)}, "
                                f"got {value!r}")
        return value


@dataclass(frozen=True)
class NameList(Kind):
    """Host names (is_origins False) or browser origins, from a TOML list or one
    comma-separated string; duplicates go, the order stays."""

    is_origins: bool = False

    @property
    def metavar(self) -> str | None:
        return "ORIGINS" if self.is_origins else "NAMES"

    @property
    def sample(self) -> Any:
        return ["http://a.lan:3000"] if self.is_origins else ["a.lan"]

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise type_error(name, "a list of strings (or one comma-separated string)", value)
        items = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))
        for item in items:
            if any(c.isspace() for c in item):
                raise SettingsError(f"{name!r}: {item!r} contains a space; "
                                    "separate entries by commas")
            if not self.is_origins and ("/" in item or item.count(":") == 1):
                raise SettingsError(f"{name!r}: {item!r} must be a bare host name or address "
                                    "(no scheme, port or path), e.g. host.docker.internal")
            if self.is_origins and item not in ("*", "null") and "://" not in item:
                raise SettingsError(f"{name!r}: {item!r} must be an origin such as "
                                    "http://localhost:3000, a pattern such as app://*, or null")
        return items


@dataclass(frozen=True)
class Command(Kind):
    """A command line (split by the platform's rules, never run by a shell) or an argv list."""

    metavar: str | None = "CMD"
    sample: Any = "notify-send hello"

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str) and value.strip():
            from strata.engine.service.before_load import split_command

            try:
                split_command(value)
            except ValueError as exc:  # an unbalanced quote: refused now, not at the first load
                raise SettingsError(f"{name!r} {value!r} is not a command line: {exc}; "
                                    "quote it evenly or give an argv list") from None
            return value
        if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, str) and v for v in value
        ):
            return tuple(value)
        raise type_error(name, "a command line or a non-empty list of strings", value)


@dataclass(frozen=True)
class ExpertCache(Kind):
    """The MoE expert cache policy, in the engine's one vocabulary (engine_config.py): auto,
    off, all, a number of expert slots (kept an int) or a size such as 8GiB."""

    metavar: str | None = "auto|off|all|N"
    sample: Any = 12

    def check(self, name: str, value: Any) -> Any:
        if is_int(value) and value >= 1:
            return value
        try:
            policy = parse_expert_cache(value) if isinstance(value, str) else None
        except ValueError:
            policy = None
        if policy is None:
            raise SettingsError(f"{name!r} must be auto, off, all, a number of expert slots "
                                f">= 1 or a size such as 8GiB, got {value!r}")
        return int(policy) if policy.isdigit() else policy

    def to_engine(self, value: Any) -> Any:
        return str(value)


@dataclass(frozen=True)
class Sampling(Kind):
    """A default sampling value for requests that leave it out; None: the model's own.
    The range is what the request field allows (low..high inclusive; is_positive: above 0,
    as top_p and repeat_penalty of 0 would filter out every token)."""

    is_integer: bool = False
    low: float = 0.0
    high: float = 1.0
    is_positive: bool = False
    metavar: str | None = "N"
    sample: Any = 1

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if self.is_integer and not is_int(value):
            raise type_error(name, "an integer", value)
        if not is_number(value):
            raise type_error(name, "a number", value)
        if not self.low <= value <= self.high or (self.is_positive and value == 0):
            raise SettingsError(f"{name!r} must be in {self.low}..{self.high}"
                                f"{' and above 0' if self.is_positive else ''}, got {value}")
        return value if self.is_integer else float(value)

    def from_flag(self, text: str) -> Any:
        return int(text) if self.is_integer else float(text)
