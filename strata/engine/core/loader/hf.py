"""Hugging Face model directories: config.json + safetensors (one file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.registry import model_module

_NEEDS = "a Hugging Face model directory needs config.json and *.safetensors"
_INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype names that widen to float32 without loss of meaning.
_FLOAT_DTYPES = ("F32", "F16", "BF16")


def _model_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ModelFormatError(f"model directory {directory} not found: {_NEEDS}")
    return directory


def _read_json(path: Path) -> dict:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(
            f"{path} is not valid JSON (line {e.lineno}): the file is damaged; download it again"
        ) from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path} does not hold a JSON object: the file is damaged")
    return data


def load_hf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory, read from its config.json."""
    directory = _model_dir(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"config.json not found in {directory}: {_NEEDS}")
    data = _read_json(config_path)
    try:
        return ModelConfig.from_hf_dict(data)
    except KeyError as e:
        raise ModelFormatError(
            f"{config_path} lacks {e.args[0]!r}: the config is incomplete; download it again"
        ) from None
    except TypeError as e:
        raise ModelFormatError(f"{config_path} has a value of the wrong type ({e})") from None


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a directory: the shards its index names, else every one."""
    directory = _model_dir(path)
    index_path = directory / _INDEX_NAME
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index_path} has no weight_map: the index is damaged")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise ModelFormatError(
                    f"shard {file.name} named in {_INDEX_NAME} not found in {directory}: "
                    "the download is incomplete; download it again"
                )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(
            f"no *.safetensors found in {directory}: {_NEEDS} (PyTorch .bin checkpoints are "
            "not read; convert them to safetensors)"
        )
    return files


def _read_file(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                dtype = f.get_slice(name).get_dtype()
                if dtype not in _FLOAT_DTYPES:
                    raise ModelFormatError(
                        f"tensor {name} in {file.name} has dtype {dtype}: Strata reads "
                        "float32/float16/bfloat16 safetensors; use an unquantized model or a GGUF"
                    )
                if name in tensors:
                    raise ModelFormatError(
                        f"tensor {name} appears in more than one file of {file.parent}: "
                        "remove the stray .safetensors files"
                    )
                tensors[name] = f.get_tensor(name).to(torch.float32)
    except SafetensorError as e:
        raise ModelFormatError(f"{file} is truncated or damaged ({e}): download it again") from None


def load_hf_tensors(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the directory as float32 on the CPU, in canonical names (sanitized)."""
    module = model_module(config.model_type)
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        _read_file(file, tensors)
    return module.sanitize(tensors, config)
