"""Model loading entry points: one call per question, whatever the file format.

- `load_model_config(path)`: the ModelConfig of a .gguf file or a Hugging Face directory.
- `open_tensors(path, config)`: every weight unread (loader/lazy.py), in canonical HF names
  and layouts and the file's dtype; the engine copies them into its arenas one at a time.
- `load_tensors(path, config)`: the same read into float32 CPU tensors (tests, parity checks).
- `inspect_model(path)`: a ModelInfo for `strata info`, read without loading any tensor.

Format modules are imported on use so that `inspect_model` (host side, `strata info`) does
not pay for importing torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.gguf_file import check_model_path, is_gguf_file

if TYPE_CHECKING:
    import torch

    from strata.engine.core.loader.lazy import LazyTensor
    from strata.engine.core.model_info import ModelInfo

__all__ = ["detect_format", "inspect_model", "load_model_config", "load_tensors", "open_tensors"]


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of `path`: gguf (a GGUF file) or hf (a directory with config.json)."""
    p = Path(path)
    check_model_path(p)  # missing, or a FIFO or device an open would block on
    if p.is_dir():
        if (p / "config.json").is_file():
            return "hf"
        raise ModelFormatError(
            f"{p} is a directory without config.json: pass a .gguf file or a Hugging Face "
            "directory (config.json + *.safetensors)"
        )
    if p.suffix.lower() == ".gguf" or is_gguf_file(p):
        return "gguf"  # a .gguf with a bad magic gets its own error from the GGUF reader
    raise ModelFormatError(
        f"{p} is neither a GGUF file nor a Hugging Face directory: pass a .gguf file or a "
        "directory with config.json and *.safetensors"
    )


def load_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The model's architecture hyper-parameters, from GGUF metadata or config.json."""
    if detect_format(path) == "gguf":
        from strata.engine.core.loader.gguf import load_gguf_config

        return load_gguf_config(path)
    from strata.engine.core.loader.hf import load_hf_config

    return load_hf_config(path)


def open_tensors(path: str | os.PathLike[str], config: ModelConfig) -> dict[str, LazyTensor]:
    """Every weight, not read yet, in canonical names, after the architecture's sanitize()."""
    from strata.engine.core.models.registry import model_module

    if detect_format(path) == "gguf":
        from strata.engine.core.loader.gguf import open_gguf_tensors

        # GGUF names are already canonical; sanitize still runs so every format ends the same
        # way (e.g. dropping a tied lm_head).
        return model_module(config.model_type).sanitize(open_gguf_tensors(path, config), config)
    from strata.engine.core.loader.hf import open_hf_tensors

    return open_hf_tensors(path, config)  # sanitizes itself


def load_tensors(path: str | os.PathLike[str], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every weight as float32 on CPU in canonical names, after the architecture's sanitize()."""
    from strata.engine.core.loader.lazy import materialize

    return materialize(open_tensors(path, config))


def inspect_model(path: str | os.PathLike[str], context_tokens: int = 0) -> ModelInfo:
    """Format, architecture, size and quantization of a model, without reading tensor data;
    for a GGUF file also the VRAM it will hold at context_tokens (0: the engine's default)."""
    from strata.engine.core.loader.inspect import inspect_gguf, inspect_hf

    p = Path(path)
    return inspect_gguf(p, context_tokens) if detect_format(p) == "gguf" else inspect_hf(p)
