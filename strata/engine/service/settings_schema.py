"""Every server setting, declared once: ServeSettings' fields are the schema (STYLE §16).

Each field carries a Setting: its kind (settings_kinds.py), flag, config key, environment
variable, unit, help, whether a change needs a restart, where it goes (an EngineConfig field,
the Service or the HTTP API) and its label in the tray's Settings window. The command line
(settings.add_serve_arguments), the config file reader (settings.load_settings), validation
(check_setting), EngineConfig (engine_config_for), the docs test and the Settings window are
all generated from this one table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from strata.engine.core.engine_config import EngineConfig
from strata.engine.service.env_names import API_KEY_ENV
from strata.engine.service.settings_kinds import (
    Boolean,
    Choice,
    Command,
    ExpertCache,
    HostAddress,
    Integer,
    Kind,
    ModelName,
    NameList,
    Sampling,
    Seconds,
    SettingsError,
    Size,
    Switch,
    Text,
)
from strata.paths import model_cache_dir
from strata.units import GIB

DEVICES = ("auto", "cpu", "cuda")
MODEL_FALLBACKS = ("off", "default")
EMBEDDING_POOLINGS = ("model", "last", "mean", "none")  # model: what the model declares
_SPEC = "strata_setting"
_DERIVED = "derived"  # flag/key from the field name: sleep_idle_s -> --sleep-idle-s


class Goes(enum.Enum):
    """Where a setting takes effect."""

    ENGINE = "engine"  # an EngineConfig field, sent to the engine process at load
    SERVICE = "service"  # the Service: lifecycle timers, VRAM guard, before-load, sampling
    API = "api"  # the HTTP runner: bind address, key, Host and Origin checks


@dataclass(frozen=True)
class Setting:
    """One row of the schema."""

    name: str  # the ServeSettings field
    kind: Kind
    default: Any
    help: str
    goes: Goes
    flag: str | None  # "--sleep-idle"; None: no flag
    key: str | None  # the config file's key, "sleep-idle"; None: not in the config file
    env: str | None = None  # an environment variable that sets it (over the file)
    engine_field: str | None = None  # the EngineConfig field, for Goes.ENGINE
    unit: str | None = None  # "s", "bytes", "MiB", "tokens"
    label: str | None = None  # the tray's Settings window; None: not shown there
    placeholder: str | None = None  # the window's hint for an empty field
    needs_restart: bool = True  # a change takes effect when the server restarts
    metavar: str | None = None  # the flag's value in --help (default: the kind's)

    def check(self, value: Any) -> Any:
        """The value validated and normalized; SettingsError naming the setting otherwise."""
        return self.kind.check(self.name, value)

    @property
    def sample(self) -> Any:
        """A valid config-file value other than the default, for tests of every setting."""
        return self.kind.sample


def setting(default: Any, kind: Kind, help: str, *, goes: Goes, flag: str | None = _DERIVED,
            key: str | None = _DERIVED, env: str | None = None, engine_field: str | None = None,
            unit: str | None = None, label: str | None = None, placeholder: str | None = None,
            needs_restart: bool = True, metavar: str | None = None) -> Any:
    """A ServeSettings field with its Setting. flag and key default to the field's name with
    dashes (the key is the flag without '--'); engine_field defaults to the field's name."""
    spec = Setting("", kind, default, help, goes, flag, key, env, engine_field, unit, label,
                   placeholder, needs_restart, metavar)
    return field(default=default, metadata={_SPEC: spec})


def _idle(flag: str, what: str, label: str) -> Any:
    return setting(None, Seconds(is_timer=True), f"seconds idle before the server {what} "
                   "(0 or absent: never)", goes=Goes.SERVICE, flag=flag, unit="s", label=label)


def _sampling(what: str, llama_cpp: str, **kind: Any) -> Any:
    return setting(None, Sampling(**kind), f"default {what} for requests that leave it out "
                   f"(unset: the model's, else {llama_cpp})", goes=Goes.SERVICE)


def _fast(env: str, what: str, default: bool | None = None) -> Any:
    kind = Switch() if default is None else Boolean()
    return setting(default, kind, what, goes=Goes.ENGINE, flag=None, key=None, env=env)


@dataclass(frozen=True)
class ServeSettings:
    """Everything `strata serve` and the tray need to run the server. Validated on creation."""

    model: str | None = setting(
        None, Text(path="file"), "GGUF file or Hugging Face directory (unset: the embedded "
        "SmolLM2-135M)", goes=Goes.SERVICE, metavar="PATH", label="Model",
        placeholder="embedded default: SmolLM2-135M-Instruct")
    alias: str | None = setting(
        None, ModelName(), "the model's name in /v1/models, /api/tags and /props (default: "
        "its file name)", goes=Goes.SERVICE, label="Model name",
        placeholder="the model file's name")
    # The model library (DESIGN §6b): requests pick a model by name (model_pool.py).
    models_dir: str | None = setting(
        None, Text(path="dir"), "directory of GGUF files and Hugging Face directories that "
        "requests may name (unset: STRATA_HOME/models, where `strata pull` puts them)",
        goes=Goes.SERVICE, env="STRATA_MODELS_DIR", metavar="DIR", label="Models directory")
    model_fallback: str = setting(
        "off", Choice(MODEL_FALLBACKS), "what a request naming an unknown model gets when "
        "there are several models (with one, it always answers): off (404), default (the "
        "default model answers; for apps with a fixed model name)",
        goes=Goes.SERVICE)
    host: str = setting("127.0.0.1", HostAddress(), "address to bind; several separated by "
                        "commas (127.0.0.1,::1)", goes=Goes.API)
    port: int = setting(8080, Integer(0, 65535), "port to listen on (0: any free port)",
                        goes=Goes.API, label="Port", placeholder="any free port")
    api_key: str | None = setting(
        None, Text(is_secret=True), "require this key (Bearer or x-api-key); visible to other "
        "users in the process list, so prefer the config file or STRATA_API_KEY",
        goes=Goes.API, env=API_KEY_ENV, metavar="KEY", label="API key",
        placeholder="none: anyone on this machine may connect")
    # Host names (besides loopback and, on a wider bind, the machine's own) and browser
    # Origins (besides the local defaults) the API accepts.
    allowed_hosts: tuple[str, ...] = setting(
        (), NameList(), "comma-separated Host names to accept besides loopback and this "
        "machine's own (e.g. host.docker.internal)", goes=Goes.API)
    allowed_origins: tuple[str, ...] = setting(
        (), NameList(is_origins=True), "comma-separated browser origins allowed to call the "
        "API besides the local ones (e.g. https://chat.example.com, http://10.0.0.5:*)",
        goes=Goes.API)
    # llama-server answers 501 on these without --metrics / with --no-slots; Strata serves
    # them unless told not to (they show usage counts and slot sizes, no text).
    metrics_endpoint: bool = setting(
        True, Boolean(sample=False), "serve GET /metrics (off: it answers 501, as llama-server without "
        "--metrics)", goes=Goes.API)
    slots_endpoint: bool = setting(
        True, Boolean(sample=False), "serve GET /slots (off: it answers 501, as llama-server with "
        "--no-slots)", goes=Goes.API)
    # llama-server's --pooling: how embeddings pool a sequence's hidden states.
    embedding_pooling: str = setting(
        "model", Choice(EMBEDDING_POOLINGS), "how embeddings pool the hidden states: model "
        "(its own declaration, else the last token's), last, mean, or none (a vector per "
        "token on /embedding and /embeddings, as llama-server; the OpenAI and Ollama routes "
        "refuse it)", goes=Goes.API, flag="--pooling", key="pooling")
    context_tokens: int = setting(
        0, Integer(0), "context length in tokens (0: the model's own, capped)",
        goes=Goes.ENGINE, flag="--context", unit="tokens", metavar="TOKENS")
    device: str = setting("auto", Choice(DEVICES), "where the engine runs",
                          goes=Goes.ENGINE)
    cache_release_idle_s: float | None = _idle(
        "--cache-release-idle", "releases the expert cache", "Release experts after idle")
    session_offload_idle_s: float | None = _idle(
        "--session-offload-idle", "offloads the KV session", "Offload session after idle")
    sleep_idle_s: float | None = _idle(
        "--sleep-idle", "sleeps (frees all VRAM, keeps the process)", "Sleep after idle")
    idle_unload_s: float | None = _idle("--idle-unload", "unloads the model", "Unload after idle")
    min_free_vram_mib: int = setting(
        0, Integer(0), "VRAM kept free on top of what a load, wake or refill maps",
        goes=Goes.SERVICE, unit="MiB", metavar="MIB", label="VRAM guard: wait for free")
    vram_wait_s: float = setting(
        15.0, Seconds(), "seconds to wait for that VRAM before answering 503",
        goes=Goes.SERVICE, flag="--vram-wait", unit="s", label="VRAM guard: wait at most")
    before_load: str | tuple[str, ...] | None = setting(
        None, Command(), "command run (without a shell) before a load or wake, e.g. to ask "
        "ComfyUI to free", goes=Goes.SERVICE, label="Before-load command",
        placeholder='e.g. curl -X POST http://127.0.0.1:8188/free -d "{}"')
    before_load_required: bool = setting(
        False, Boolean(), "fail the load when the before-load command fails", goes=Goes.SERVICE)
    persist_sessions: bool = setting(False, Boolean(), "keep KV snapshots on disk across "
                                     "restarts", goes=Goes.ENGINE)
    snapshot_dir: str | None = setting(
        None, Text(path="dir"), "where KV snapshots go (unset: STRATA_HOME/snapshots)",
        goes=Goes.ENGINE, metavar="DIR", label="Snapshot directory")
    snapshot_ram_budget_bytes: int = setting(
        4 * GIB, Size(), "host RAM for KV snapshots, e.g. 4GiB", goes=Goes.ENGINE,
        flag="--snapshot-ram-budget", unit="bytes", label="Snapshot RAM budget")
    snapshot_disk_budget_bytes: int = setting(
        16 * GIB, Size(), "disk space for KV snapshots, e.g. 16GiB", goes=Goes.ENGINE,
        flag="--snapshot-disk-budget", unit="bytes", label="Snapshot disk budget")
    snapshot_ttl_s: float = setting(0.0, Seconds(), "seconds a KV snapshot stays valid "
                                    "(0: forever)", goes=Goes.ENGINE, flag="--snapshot-ttl",
                                    unit="s")
    kv_budget_bytes: int = setting(
        0, Size(), "VRAM for the KV of resident cache slots; past it the least recently used "
        "slot is snapshotted (0: no limit)", goes=Goes.ENGINE, flag="--kv-budget", unit="bytes")
    expert_cache: str | int = setting(
        "auto", ExpertCache(), "MoE expert cache: auto, off, all, a number of expert slots or "
        "a size such as 8GiB", goes=Goes.ENGINE)
    # Sampling defaults for requests that leave them out; None: the model's, else llama.cpp's.
    temperature: float | None = _sampling("temperature", "0.8", low=0.0, high=2.0)
    top_k: int | None = _sampling("top k", "40", is_integer=True, low=0, high=1 << 20)
    top_p: float | None = _sampling("top p", "0.95", low=0.0, high=1.0, is_positive=True)
    min_p: float | None = _sampling("min p", "0.05", low=0.0, high=1.0)
    repeat_penalty: float | None = _sampling("repeat penalty", "1.0: off", low=0.0, high=10.0,
                                             is_positive=True)
    repeat_last_n: int | None = _sampling("repeat last n", "64; -1: the whole context",
                                          is_integer=True, low=-1, high=1 << 20)
    seed: int | None = setting(
        None, Sampling(is_integer=True, low=0, high=2**64 - 1), "default sampling seed for "
        "requests that leave it out (unset: a random one for each request)",
        goes=Goes.SERVICE)
    max_tokens: int | None = setting(
        None, Sampling(is_integer=True, low=1, high=1 << 24), "most tokens a request "
        "generates: the default for one that leaves max_tokens out, and a cap on one that asks "
        "for more (finish reason 'length'); unset: up to the end of the context",
        goes=Goes.SERVICE)
    vram_budget_bytes: int = setting(
        0, Size(), "VRAM the engine may map in all (weights, experts, KV), e.g. 16GiB to act "
        "as a 16 GiB card; the expert cache sizes itself inside it (0: no limit)",
        goes=Goes.ENGINE, flag="--vram-budget", unit="bytes")
    # Continuous batching (DESIGN §5).
    slots: int = setting(4, Integer(1), "KV cache slots (strata_cache_slot 0..N-1)",
                         goes=Goes.ENGINE, engine_field="num_slots")
    parallel: int = setting(0, Integer(0), "sequences that decode together (0: one per slot)",
                            goes=Goes.ENGINE)
    # A new engine process imports torch before it answers; the first import after an install
    # or an update is slow where an antivirus (Windows Defender) scans each of torch's DLLs.
    engine_start_timeout_s: float = setting(
        180.0, Seconds(), "seconds a new engine process may take to start (its first import "
        "of torch, slow while an antivirus scans torch's files) before the start fails",
        goes=Goes.SERVICE, flag="--engine-start-timeout", unit="s")
    max_queue: int = setting(64, Integer(1), "requests that may wait for a turn; past it the "
                             "server answers 503 with Retry-After", goes=Goes.SERVICE)
    # The fast decode path's switches, for diagnosing a GPU-specific problem: environment only.
    fast_decode: bool = _fast("STRATA_FAST", "decode and prefill with CUDA graphs and the "
                              "compiled and Triton kernels (0: the plain torch path)", True)
    fast_cuda_graphs: bool | None = _fast("STRATA_FAST_GRAPHS", "CUDA graphs for decode")
    fast_compile_pointwise: bool | None = _fast("STRATA_FAST_COMPILE",
                                                "torch.compile'd element-wise groups")
    fast_fused_attention: bool | None = _fast("STRATA_FAST_ATTENTION",
                                              "the Triton decode attention")
    fast_dense_kernels: bool | None = _fast("STRATA_FAST_DENSE",
                                            "the Triton projections and norms of one token")
    fast_prefill_graphs: bool = _fast("STRATA_FAST_PREFILL_GRAPHS",
                                      "CUDA graphs for the prefill of fresh prompts", True)

    def __post_init__(self) -> None:
        for spec in SETTINGS:
            object.__setattr__(self, spec.name, spec.check(getattr(self, spec.name)))
        if self.parallel > self.slots:
            raise SettingsError(f"'parallel' must be 0..slots ({self.slots}), "
                                f"got {self.parallel}")

    @property
    def library_dir(self) -> Path:
        """The model library: models_dir, else the model cache (where `strata pull` puts
        models). The pool serves from it; `strata pull/list/rm` work on it."""
        return Path(self.models_dir).expanduser() if self.models_dir else model_cache_dir()

    @property
    def before_load_argv(self) -> list[str] | None:
        """The before-load command as an argv list (a string split by the platform's rules)."""
        if self.before_load is None:
            return None
        if isinstance(self.before_load, str):
            from strata.engine.service.before_load import split_command

            return split_command(self.before_load)
        return list(self.before_load)


def _named(f: Any) -> Setting:
    spec: Setting = f.metadata[_SPEC]
    flag = "--" + f.name.replace("_", "-") if spec.flag == _DERIVED else spec.flag
    key = (flag[2:] if flag else f.name.replace("_", "-")) if spec.key == _DERIVED else spec.key
    engine_field = spec.engine_field or (f.name if spec.goes is Goes.ENGINE else None)
    return replace(spec, name=f.name, flag=flag, key=key, engine_field=engine_field)


SETTINGS: tuple[Setting, ...] = tuple(_named(f) for f in fields(ServeSettings))
BY_NAME = {spec.name: spec for spec in SETTINGS}
SETTING_NAMES = tuple(BY_NAME)
# A config key (dashes or underscores) -> the field: its documented key, or the field's name.
_KEY_TO_FIELD = {
    alias: spec.name
    for spec in SETTINGS if spec.key is not None
    for alias in (spec.name, spec.key.replace("-", "_"))
}
CONFIG_KEYS = tuple(spec.key for spec in SETTINGS if spec.key is not None)


def field_for_key(key: str) -> str | None:
    """The ServeSettings field a config key (or a field or flag name) sets; None if none."""
    return _KEY_TO_FIELD.get(key.removeprefix("--").replace("-", "_"))


def check_setting(name: str, value: Any) -> Any:
    """Validate one setting and return it normalized; raise SettingsError saying what is wrong."""
    spec = BY_NAME.get(name)
    if spec is None:
        raise SettingsError(f"unknown setting {name!r}; known settings: {', '.join(CONFIG_KEYS)}")
    return spec.check(value)


def engine_config_for(settings: ServeSettings, model_path: str) -> EngineConfig:
    """The EngineConfig the settings ask for: every Goes.ENGINE setting, by its field."""
    values = {spec.engine_field: spec.kind.to_engine(getattr(settings, spec.name))
              for spec in SETTINGS if spec.goes is Goes.ENGINE and spec.engine_field}
    return EngineConfig(model_path=model_path, **values)
