"""Architecture modules by Hugging Face model_type; each exports `Model` and `sanitize`."""

from __future__ import annotations

import importlib
from types import ModuleType

from strata.engine.core.model_config import ModelFormatError

# model_type -> module name under strata.engine.core.models; imported on first use.
_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "mistral": "mistral",
    "ministral3": "ministral3",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
}


def supported_model_types() -> tuple[str, ...]:
    """The model_type values Strata can build."""
    return tuple(_ARCHITECTURES)


def model_module(model_type: str) -> ModuleType:
    """The architecture module for `model_type` (exports Model(config) and sanitize)."""
    module_name = _ARCHITECTURES.get(model_type)
    if module_name is None:
        raise ModelFormatError(
            f"unsupported architecture {model_type!r}: Strata runs "
            f"{', '.join(_ARCHITECTURES)}; pick a model of one of those families"
        )
    return importlib.import_module(f"strata.engine.core.models.{module_name}")


def model_class(model_type: str) -> type:
    """The `Model` class for `model_type` (the name docs/architecture.md uses)."""
    return model_module(model_type).Model
