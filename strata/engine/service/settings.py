"""Server settings from the config file, the environment and the command line; a later one wins.

Every setting is declared once, in settings_schema.py (ServeSettings' fields); this module is
its front door: load_settings reads a config file's keys (the documented key, or the field's
name, with dashes or underscores), then the environment variables the schema names, then the
flags, which add_serve_arguments generates from the same table. Flags default to None, so only
the ones given override.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from strata.engine.service.config_file import read_config
from strata.engine.service.settings_kinds import (
    Boolean,
    Choice,
    Sampling,
    Seconds,
    SettingsError,
    Size,
    parse_bytes,
)
from strata.engine.service.settings_schema import (
    BY_NAME,
    CONFIG_KEYS,
    DEVICES,
    SETTING_NAMES,
    SETTINGS,
    Goes,
    ServeSettings,
    Setting,
    check_setting,
    engine_config_for,
    field_for_key,
)
from strata.units import GIB

__all__ = [
    "API_KEY_ENV", "DEVICES", "GIB", "IDLE_FIELDS", "SETTINGS", "SETTING_NAMES", "Goes",
    "ServeSettings", "Setting", "SettingsError", "add_serve_arguments", "add_setting_argument",
    "check_setting", "default_config_file", "engine_config_for", "environment_values",
    "field_for_key", "load_settings", "overrides_from_args", "parse_bytes",
    "settings_from_config",
]

# The API key may come from the environment, so that it need not be on a command line.
API_KEY_ENV = BY_NAME["api_key"].env
IDLE_FIELDS = tuple(s.name for s in SETTINGS if isinstance(s.kind, Seconds) and s.kind.is_timer)
SAMPLING_KEYS = tuple(s.name for s in SETTINGS if isinstance(s.kind, Sampling))
# Tables of the same config file that belong to other parts (the rules, the tray window and
# the model pool's [models.NAME] tables).
OTHER_SECTIONS = ("rules", "tray", "models")


def default_config_file() -> Path | None:
    """The standard config file when it exists ($STRATA_CONFIG or ~/.config/strata/config.toml)."""
    from strata.paths import config_path

    path = config_path()
    return path if path.is_file() else None


def environment_values(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings that environment variables set (STRATA_API_KEY, STRATA_FAST*): the one
    place the host reads them. An empty variable counts as unset."""
    environ = os.environ if environ is None else environ
    values = {}
    for spec in SETTINGS:
        if not spec.env:
            continue
        text = environ.get(spec.env, "").strip()
        if text:
            values[spec.name] = spec.kind.from_env(spec.env, text)
    return values


def _file_values(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings of a parsed config file, checked; `where` names it in every message."""
    data = dict(data)
    sampling = data.pop("sampling", None)
    if sampling is not None:  # a [sampling] table holds the sampling keys, as top-level ones
        if not isinstance(sampling, dict):
            raise SettingsError(f"{where}: 'sampling' must be a table of "
                                f"{', '.join(SAMPLING_KEYS)}")
        for key, value in sampling.items():
            if key.replace("-", "_") not in SAMPLING_KEYS:
                raise SettingsError(f"{where}: unknown key {key!r} in [sampling]; "
                                    f"known keys: {', '.join(SAMPLING_KEYS)}")
            if key.replace("-", "_") in {k.replace("-", "_") for k in data}:
                raise SettingsError(f"{where}: {key!r} is set both at the top level and in "
                                    "[sampling]; keep one")
            data[key] = value
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in OTHER_SECTIONS and isinstance(value, (dict, list)):
            continue
        name = field_for_key(key)
        if name is None:
            raise SettingsError(f"{where}: unknown key {key!r}; known keys: "
                                f"{', '.join(CONFIG_KEYS)}")
        try:  # the message names the key as the file spells it
            values[name] = BY_NAME[name].kind.check(key, value)
        except SettingsError as exc:
            raise SettingsError(f"{where}: {exc}") from None
    return values


def settings_from_config(data: Mapping[str, Any], overrides: Mapping[str, Any], *,
                         where: str = "config file",
                         environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings from a parsed config file, the environment and overrides, in that order.

    Overrides are field names (or flag names) to values; None values are ignored, so argparse
    defaults never override the file. Raises SettingsError with a one-line message.
    """
    values = _file_values(data, where)
    values.update(environment_values(environ))
    for key, value in overrides.items():
        if value is None:
            continue
        name = field_for_key(key)
        if name is None:
            raise SettingsError(f"unknown setting {key!r}; known settings: "
                                f"{', '.join(CONFIG_KEYS)}")
        values[name] = value
    return ServeSettings(**values)


def config_file_path(config_file: str | Path | None) -> Path | None:
    """The file to read: the one named (which must exist), else the standard one if present."""
    return Path(config_file).expanduser() if config_file is not None else default_config_file()


def load_settings(config_file: str | Path | None, overrides: Mapping[str, Any],
                  environ: Mapping[str, str] | None = None) -> ServeSettings:
    """Settings from a TOML file (None: the standard one if it exists), the environment
    ($STRATA_API_KEY wins over the file's api-key) and overrides (a flag wins over both)."""
    path = config_file_path(config_file)
    data = read_config(path, must_exist=True) if path is not None else {}
    return settings_from_config(data, overrides, where=f"config file {path}", environ=environ)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings among parsed arguments (from add_serve_arguments), for load_settings."""
    return {name: getattr(args, name) for name in SETTING_NAMES if hasattr(args, name)}


def _flag_type(spec: Setting) -> Any:
    def parse(text: str) -> Any:
        try:
            return spec.kind.from_flag(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = spec.name  # argparse names it in "invalid <name> value"
    return parse


def default_text(spec: Setting) -> str | None:
    """The default as --help shows it; None when unset, off or empty."""
    value = spec.default
    if value is None or value is False or value == ():
        return None
    if isinstance(spec.kind, Size) and value and value % GIB == 0:
        return f"{value // GIB}GiB"
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_setting_argument(parser: argparse.ArgumentParser, name: str, *, default: Any = None,
                         help: str | None = None) -> None:
    """Add one setting's flag as the schema declares it (dest: the field name)."""
    spec = BY_NAME[name]
    if spec.flag is None:
        raise ValueError(f"setting {name!r} has no flag")
    shown = default_text(spec)
    text = help or spec.help + (f" (default {shown})" if shown else "")
    options: dict[str, Any] = {"dest": spec.name, "default": default,
                               "help": text.replace("%", "%%")}
    if isinstance(spec.kind, Boolean):
        options["action"] = argparse.BooleanOptionalAction
    elif isinstance(spec.kind, Choice):
        options["choices"] = spec.kind.options
    else:
        options["type"] = _flag_type(spec)
        options["metavar"] = spec.metavar or spec.kind.metavar
    parser.add_argument(spec.flag, **options)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server flags; every one defaults to None so only the given ones override."""
    parser.add_argument("--config", metavar="FILE",
                        help="TOML config file (default: ~/.config/strata/config.toml)")
    for spec in SETTINGS:
        if spec.flag is not None:
            add_setting_argument(parser, spec.name)
