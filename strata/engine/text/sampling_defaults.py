"""Default sampling parameters: the server's settings, else the model's own, else llama.cpp's.

A request's explicit values always win (api/params.py); these fill what it leaves out. The
model's defaults come from GGUF `general.sampling.*` keys (what llama.cpp's converter writes
from generation_config.json) or a Hugging Face directory's `generation_config.json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

# llama.cpp's common_params_sampling defaults (common/common.h): what its server samples with.
LLAMA_CPP_SOURCE = "llama.cpp"

# GGUF metadata key -> field (llama.cpp's gguf-py Keys.General.SAMPLING_*).
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
}
# generation_config.json key -> field (transformers' GenerationConfig names).
HF_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repeat_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets; `sources` says where each came
    from (settings, model, or llama.cpp)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # the window of penalties: last N tokens; -1: the whole context
    seed: int | None = None  # None: a new random seed for each request
    max_tokens: int | None = None  # None: up to the context's end; else also a cap
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def params(self) -> dict[str, Any]:
        """The values in llama.cpp's /props `default_generation_settings.params` names."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "min_p": self.min_p, "repeat_penalty": self.repeat_penalty,
                "repeat_last_n": self.repeat_last_n, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "seed": self.seed,
                "n_predict": -1 if self.max_tokens is None else self.max_tokens}


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingDefaults) if f.name != "sources")


def _number(value: Any, name: str) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if name in ("top_k", "repeat_last_n") else float(value)


def _checked(values: dict[str, Any]) -> dict[str, float | int]:
    """Only the fields with numbers in their valid range; a model's odd value is skipped."""
    valid = {
        "temperature": lambda x: 0.0 <= x <= 5.0, "top_k": lambda x: x >= 0,
        "top_p": lambda x: 0.0 < x <= 1.0, "min_p": lambda x: 0.0 <= x <= 1.0,
        "repeat_penalty": lambda x: 0.0 < x <= 10.0, "repeat_last_n": lambda x: x >= -1,
    }
    out = {}
    for name, value in values.items():
        number = _number(value, name)
        if number is not None and valid[name](number):
            out[name] = number
    return out


def read_model_sampling(model_path: str | Path | None) -> dict[str, float | int]:
    """The sampling defaults a model file declares ({} when none, or the path is unknown)."""
    if not model_path:
        return {}
    path = Path(model_path)
    if path.is_dir():
        try:
            data = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        values = {name: data[key] for key, name in HF_SAMPLING_KEYS.items() if key in data}
        if data.get("do_sample") is False:  # transformers then decodes greedily
            values["temperature"] = 0.0
        return _checked(values)
    from strata.engine.gguf_file import is_gguf_file, open_gguf

    if not is_gguf_file(path):
        return {}
    reader = open_gguf(path)
    values = {name: reader.metadata.get(key) for key, name in GGUF_SAMPLING_KEYS.items()}
    return _checked({k: v for k, v in values.items() if v is not None})


def resolve_sampling_defaults(model_values: dict[str, Any], configured: dict[str, Any],
                              model_source: str = "model") -> SamplingDefaults:
    """Settings (configured, None: unset) over the model's values over llama.cpp's."""
    defaults = SamplingDefaults()
    values: dict[str, Any] = {}
    sources = {name: LLAMA_CPP_SOURCE for name in SAMPLING_FIELDS}
    for name, value in model_values.items():
        values[name], sources[name] = value, model_source
    for name, value in configured.items():
        if value is not None:
            values[name], sources[name] = value, "settings"
    return replace(defaults, **values, sources=sources)


def as_dict(defaults: SamplingDefaults) -> dict[str, Any]:
    """Plain values for /v1/status and logs."""
    return asdict(defaults)
