"""Server settings: one frozen dataclass, read from the TOML config file and the command line.

Config keys are the field names, with dashes or underscores, or the flag names without the
leading dashes (`cache-release-idle` for cache_release_idle_s). Command-line flags win over the
file; flags default to None so only the ones given override.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from strata.errors import StrataError
from strata.units import GIB

# The API key may come from the environment, so that it need not be on a command line.
API_KEY_ENV = "STRATA_API_KEY"
IDLE_FIELDS = ("cache_release_idle_s", "session_offload_idle_s", "sleep_idle_s", "idle_unload_s")
EXPERT_CACHE_WORDS = ("auto", "off", "all")
DEVICES = ("auto", "cpu", "cuda")
MAX_SLOTS = 256  # cache slots (and parallel sequences) a server may be given
# Tables of the same config file that belong to other parts (the tray's rules and window).
OTHER_SECTIONS = ("rules", "tray")


class SettingsError(StrataError, ValueError):
    """A setting with a wrong name, type or value; the message names it and says what to do."""


@dataclass(frozen=True)
class ServeSettings:
    """Everything `strata serve` and the tray need to run the server. Validated on creation."""

    model: str | None = None  # None: the embedded default model
    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port
    api_key: str | None = None
    # Host names (besides loopback and, on a wider bind, the machine's own) and browser
    # Origins (besides the local defaults) the API accepts.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    context_tokens: int = 0  # 0: the model's own context length (capped by the engine)
    device: str = "auto"
    cache_release_idle_s: float | None = None  # idle timers: None = off
    session_offload_idle_s: float | None = None
    sleep_idle_s: float | None = None
    idle_unload_s: float | None = None
    min_free_vram_mib: int = 0
    vram_wait_s: float = 15.0
    before_load: str | tuple[str, ...] | None = None  # a command line, or an argv list
    before_load_required: bool = False  # a failing before-load command stops the load
    persist_sessions: bool = False
    snapshot_dir: str | None = None  # None: strata.paths.snapshot_dir()
    snapshot_ram_budget_bytes: int = 4 * GIB
    snapshot_disk_budget_bytes: int = 16 * GIB
    snapshot_ttl_s: float = 0.0  # 0: snapshots never expire
    kv_budget_bytes: int = 0  # KV of resident slots; 0: every slot may stay resident
    expert_cache: str | int = "auto"  # auto | off | all | a number of expert slots
    # Sampling defaults for requests that leave them out; None: the model's, else llama.cpp's.
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    vram_budget_bytes: int = 0  # all the engine's arenas together; 0: the GPU's own size
    slots: int = 4  # KV cache slots, 0..slots-1
    parallel: int = 0  # sequences decoded together; 0: one per slot
    max_queue: int = 64  # generations that may wait beyond those; past it 503

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, check_setting(f.name, getattr(self, f.name)))
        if self.parallel > self.slots:
            raise SettingsError(f"'parallel' ({self.parallel}) cannot exceed 'slots' "
                                f"({self.slots}): each running sequence needs a slot")

    @property
    def before_load_argv(self) -> list[str] | None:
        """The before-load command as an argv list (a string split by the platform's rules)."""
        if self.before_load is None:
            return None
        if isinstance(self.before_load, str):
            from strata.engine.service.before_load import split_command

            return split_command(self.before_load)
        return list(self.before_load)


SETTING_NAMES = tuple(f.name for f in fields(ServeSettings))

# flag (without --) -> field, for the flags whose name differs from the field's
FLAG_NAMES = {
    "context": "context_tokens",
    "cache-release-idle": "cache_release_idle_s",
    "session-offload-idle": "session_offload_idle_s",
    "sleep-idle": "sleep_idle_s",
    "idle-unload": "idle_unload_s",
    "vram-wait": "vram_wait_s",
    "snapshot-ram-budget": "snapshot_ram_budget_bytes",
    "snapshot-disk-budget": "snapshot_disk_budget_bytes",
    "snapshot-ttl": "snapshot_ttl_s",
    "kv-budget": "kv_budget_bytes",
    "vram-budget": "vram_budget_bytes",
    "max-queue": "max_queue",
}
_KEY_TO_FIELD = {name: name for name in SETTING_NAMES} | {
    flag.replace("-", "_"): name for flag, name in FLAG_NAMES.items()
}


def _type_error(name: str, expected: str, value: Any) -> SettingsError:
    return SettingsError(f"{name!r} must be {expected}, got {value!r} ({type(value).__name__})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_bytes(text: str | int) -> int:
    """A byte count from an int or a string like '512MiB', '4 GiB', '2GB' or '1024'."""
    if _is_int(text):
        return int(text)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size; write e.g. 4GiB, 512MiB or a number of bytes")
    number, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if prefix and not binary and str(text).strip()[-1:] in "bB" else 1024
    return int(float(number) * base**power)


def check_setting(name: str, value: Any) -> Any:
    """Validate one setting and return it normalized; raise SettingsError saying what is wrong."""
    if name in ("model", "api_key", "snapshot_dir"):
        if value is None:
            return None
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise _type_error(name, "a non-empty string", value)
        return os.path.expanduser(value) if name != "api_key" else value
    if name in ("allowed_hosts", "allowed_origins"):
        return _check_name_list(name, value)
    if name == "host":
        if not isinstance(value, str) or not value.strip():
            raise _type_error(name, "a host name or address", value)
        return value
    if name in ("port", "context_tokens", "min_free_vram_mib"):
        if not _is_int(value):
            raise _type_error(name, "an integer", value)
        if value < 0 or (name == "port" and value > 65535):
            limit = "0..65535" if name == "port" else ">= 0"
            raise SettingsError(f"{name!r} must be {limit}, got {value}")
        return value
    if name in ("slots", "parallel", "max_queue"):
        if not _is_int(value):
            raise _type_error(name, "an integer", value)
        low, high = (1 if name == "slots" else 0), (None if name == "max_queue" else MAX_SLOTS)
        if value < low or (high is not None and value > high):
            limit = f">= {low}" if high is None else f"{low}..{high}"
            raise SettingsError(f"{name!r} must be {limit}, got {value}")
        return value
    if name == "device":
        if value not in DEVICES:
            raise SettingsError(f"'device' must be one of {', '.join(DEVICES)}, got {value!r}")
        return value
    if name in IDLE_FIELDS or name == "vram_wait_s":
        if value is None and name in IDLE_FIELDS:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _type_error(name, "a number of seconds", value)
        if value < 0:
            raise SettingsError(f"{name!r} must be >= 0 seconds, got {value}")
        # 0 turns an idle timer off, so a flag can override a value from the config file.
        return None if name in IDLE_FIELDS and value == 0 else float(value)
    if name == "before_load":
        if value is None:
            return None
        if isinstance(value, str) and value.strip():
            from strata.engine.service.before_load import split_command

            try:
                split_command(value)
            except ValueError as exc:  # an unbalanced quote: refused now, not at the first load
                raise SettingsError(f"'before_load' {value!r} is not a command line: {exc}; "
                                    "quote it evenly or give an argv list") from None
            return value
        if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, str) and v for v in value
        ):
            return tuple(value)
        raise _type_error(name, "a command line or a non-empty list of strings", value)
    if name in ("before_load_required", "persist_sessions"):
        if not isinstance(value, bool):
            raise _type_error(name, "true or false", value)
        return value
    if name == "snapshot_ttl_s":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise _type_error(name, "a number of seconds >= 0", value)
        return float(value)
    if name in ("snapshot_ram_budget_bytes", "snapshot_disk_budget_bytes", "kv_budget_bytes",
                "vram_budget_bytes"):
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            raise _type_error(name, "a size such as 4GiB or a number of bytes", value)
        try:
            size_bytes = parse_bytes(value)
        except ValueError as exc:
            raise SettingsError(f"{name!r}: {exc}") from None
        if size_bytes < 0:
            raise SettingsError(f"{name!r} must be >= 0 bytes, got {value}")
        return size_bytes
    if name == "expert_cache":
        if _is_int(value) and value >= 1:
            return value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        if value in EXPERT_CACHE_WORDS:
            return value
        raise SettingsError(
            f"'expert_cache' must be auto, off, all or a number of expert slots >= 1, got {value!r}"
        )
    if name in SAMPLING_RANGES:
        return _check_sampling(name, value)
    raise SettingsError(f"unknown setting {name!r}; known settings: {', '.join(SETTING_NAMES)}")


def _check_name_list(name: str, value: Any) -> tuple[str, ...]:
    """A list of host names or origins, from a TOML list or a comma-separated string."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _type_error(name, "a list of strings (or one comma-separated string)", value)
    items = tuple(dict.fromkeys(v.strip() for v in value if v.strip()))
    for item in items:
        if any(c.isspace() for c in item):
            raise SettingsError(f"{name!r}: {item!r} contains a space; separate entries by commas")
        if name == "allowed_hosts" and ("/" in item or item.count(":") == 1):
            raise SettingsError(f"'allowed_hosts': {item!r} must be a bare host name or address "
                                "(no scheme, port or path), e.g. host.docker.internal")
        if name == "allowed_origins" and item not in ("*", "null") and "://" not in item:
            raise SettingsError(f"'allowed_origins': {item!r} must be an origin such as "
                                "http://localhost:3000, a pattern such as app://*, or null")
    return items


# Sampling settings: (is_integer, low, high) inclusive, as the request fields allow them.
SAMPLING_RANGES = {
    "temperature": (False, 0.0, 2.0), "top_k": (True, 0, 1 << 20),
    "top_p": (False, 0.0, 1.0), "min_p": (False, 0.0, 1.0),
    "repeat_penalty": (False, 0.0, 10.0), "repeat_last_n": (True, -1, 1 << 20),
}


def _check_sampling(name: str, value: Any) -> Any:
    if value is None:
        return None
    is_integer, low, high = SAMPLING_RANGES[name]
    if is_integer and not _is_int(value):
        raise _type_error(name, "an integer", value)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _type_error(name, "a number", value)
    # top_p and repeat_penalty of 0 would filter out every token.
    if not low <= value <= high or (name in ("top_p", "repeat_penalty") and value == 0):
        raise SettingsError(f"{name!r} must be in {low}..{high}"
                            f"{' and above 0' if name in ('top_p', 'repeat_penalty') else ''}, "
                            f"got {value}")
    return value if is_integer else float(value)


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist; create it or drop --config") from None
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}; fix it") from None
    values: dict[str, Any] = {}
    sampling = data.pop("sampling", None)
    if sampling is not None:  # a [sampling] table holds the sampling keys, as top-level ones
        if not isinstance(sampling, dict):
            raise SettingsError(f"config file {path}: 'sampling' must be a table of "
                                f"{', '.join(SAMPLING_RANGES)}")
        for key, value in sampling.items():
            if key.replace("-", "_") not in SAMPLING_RANGES:
                raise SettingsError(f"config file {path}: unknown key {key!r} in [sampling]; "
                                    f"known keys: {', '.join(SAMPLING_RANGES)}")
            if key.replace("-", "_") in {k.replace("-", "_") for k in data}:
                raise SettingsError(f"config file {path}: {key!r} is set both at the top "
                                    "level and in [sampling]; keep one")
            data[key] = value
    for key, value in data.items():
        if key in OTHER_SECTIONS and isinstance(value, (dict, list)):
            continue
        name = _KEY_TO_FIELD.get(key.replace("-", "_"))
        if name is None:
            raise SettingsError(
                f"config file {path}: unknown key {key!r}; "
                f"known keys: {', '.join(k.replace('_', '-') for k in SETTING_NAMES)}"
            )
        try:
            values[name] = check_setting(name, value)
        except SettingsError as exc:
            raise SettingsError(f"config file {path}: {exc}") from None
    return values


def default_config_file() -> Path | None:
    """The standard config file when it exists ($STRATA_CONFIG or ~/.config/strata/config.toml)."""
    from strata.paths import config_path

    path = config_path()
    return path if path.is_file() else None


def load_settings(config_file: Path | None, overrides: dict[str, Any]) -> ServeSettings:
    """Settings from a TOML file (None: the standard one if it exists) and overrides.

    Overrides are field names (or flag names) to values; None values are ignored, so argparse
    defaults never override the file. $STRATA_API_KEY, when set, wins over the file's api-key
    (a flag wins over both). Raises SettingsError with a one-line message.
    """
    path = Path(config_file).expanduser() if config_file is not None else default_config_file()
    values = _read_config_file(path) if path is not None else {}
    if os.environ.get(API_KEY_ENV, "").strip():
        values["api_key"] = check_setting("api_key", os.environ[API_KEY_ENV].strip())
    for key, value in overrides.items():
        if value is None:
            continue
        name = _KEY_TO_FIELD.get(key.replace("-", "_"))
        if name is None:
            raise SettingsError(f"unknown setting {key!r}; known settings: {', '.join(SETTING_NAMES)}")
        values[name] = value
    return ServeSettings(**values)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings among parsed arguments (from add_serve_arguments), for load_settings."""
    return {name: getattr(args, name) for name in SETTING_NAMES if hasattr(args, name)}


def _positive_or_zero_number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server flags; every one defaults to None so only the given ones override."""
    add = parser.add_argument
    add("--model", metavar="PATH", help="GGUF file or Hugging Face directory (default: SmolLM2-135M)")
    add("--config", metavar="FILE", help="TOML config file (default: ~/.config/strata/config.toml)")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="port to listen on (default 8080, 0: any free port)")
    add("--api-key", dest="api_key",
        help="require this key (Bearer or x-api-key); visible to other users in the process "
        "list, so prefer the config file or STRATA_API_KEY")
    add("--allowed-hosts", dest="allowed_hosts", metavar="NAMES",
        help="comma-separated Host names to accept besides loopback and this machine's own "
        "(e.g. host.docker.internal)")
    add("--allowed-origins", dest="allowed_origins", metavar="ORIGINS",
        help="comma-separated browser origins allowed to call the API besides the local ones "
        "(e.g. https://chat.example.com, http://10.0.0.5:*)")
    add("--context", dest="context_tokens", type=int, metavar="TOKENS",
        help="context length in tokens (default: the model's own, capped)")
    add("--device", choices=DEVICES, help="where the engine runs (default auto)")
    idle_help = "seconds idle before the server {} (0 or absent: never)"
    for flag, field_name, what in (
        ("--cache-release-idle", "cache_release_idle_s", "releases the expert cache"),
        ("--session-offload-idle", "session_offload_idle_s", "offloads the KV session"),
        ("--sleep-idle", "sleep_idle_s", "sleeps (frees all VRAM, keeps the process)"),
        ("--idle-unload", "idle_unload_s", "unloads the model"),
    ):
        add(flag, dest=field_name, type=_positive_or_zero_number, metavar="S",
            help=idle_help.format(what))
    add("--min-free-vram-mib", dest="min_free_vram_mib", type=int, metavar="MIB",
        help="VRAM kept free on top of what a load, wake or refill maps (default 0)")
    add("--vram-wait", dest="vram_wait_s", type=_positive_or_zero_number, metavar="S",
        help="seconds to wait for that VRAM before answering 503 (default 15)")
    add("--before-load", dest="before_load", metavar="CMD",
        help="command run (without a shell) before a load or wake, e.g. to ask ComfyUI to free")
    add("--before-load-required", dest="before_load_required",
        action=argparse.BooleanOptionalAction, default=None,
        help="fail the load when the before-load command fails")
    add("--persist-sessions", dest="persist_sessions", action=argparse.BooleanOptionalAction,
        default=None, help="keep KV snapshots on disk across restarts")
    add("--snapshot-dir", dest="snapshot_dir", metavar="DIR", help="where KV snapshots go")
    add("--snapshot-ram-budget", dest="snapshot_ram_budget_bytes", type=_size, metavar="SIZE",
        help="host RAM for KV snapshots, e.g. 4GiB")
    add("--snapshot-disk-budget", dest="snapshot_disk_budget_bytes", type=_size, metavar="SIZE",
        help="disk space for KV snapshots, e.g. 16GiB")
    add("--snapshot-ttl", dest="snapshot_ttl_s", type=_positive_or_zero_number, metavar="S",
        help="seconds a KV snapshot stays valid (0: forever)")
    add("--kv-budget", dest="kv_budget_bytes", type=_size, metavar="SIZE",
        help="VRAM for the KV of resident cache slots; past it the least recently used slot "
        "is snapshotted (0: no limit)")
    add("--vram-budget", dest="vram_budget_bytes", type=_size, metavar="SIZE",
        help="VRAM the engine may map in all (weights, experts, KV), e.g. 16GiB to act as "
        "a 16 GiB card; the expert cache sizes itself inside it (0: no limit)")
    add("--slots", dest="slots", type=int, metavar="N",
        help="KV cache slots, each keeping one conversation's prefix (default 4)")
    add("--parallel", dest="parallel", type=int, metavar="N",
        help="sequences decoded together, at most --slots (default 0: one per slot)")
    add("--max-queue", dest="max_queue", type=int, metavar="N",
        help="requests that may wait for a place beyond those; past it 503 (default 64)")
    add("--expert-cache", dest="expert_cache", metavar="auto|off|all|N",
        help="MoE expert cache: auto, off, all, or a number of expert slots")
    sampling_help = "default {} for requests that leave it out (default: the model's, else {})"
    for flag, field_name, kind, llama_cpp in (
        ("--temperature", "temperature", float, "0.8"), ("--top-k", "top_k", int, "40"),
        ("--top-p", "top_p", float, "0.95"), ("--min-p", "min_p", float, "0.05"),
        ("--repeat-penalty", "repeat_penalty", float, "1.0: off"),
        ("--repeat-last-n", "repeat_last_n", int, "64; -1: the whole context"),
    ):
        add(flag, dest=field_name, type=kind, metavar="N",
            help=sampling_help.format(field_name.replace("_", " "), llama_cpp))
