"""Hugging Face model directories: config.json + safetensors (one file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from strata.engine.core.loader.lazy import DeferredTensor, LazyTensor, materialize
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.registry import model_module

_NEEDS = "a Hugging Face model directory needs config.json and *.safetensors"
_INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype names Strata reads (each widens to float32 without loss of meaning).
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_MXFP4_SUFFIXES = ("_blocks", "_scales")  # gpt-oss's MXFP4 experts: uint8 blocks, exponents


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


def _dtype_of(file: Path, name: str, dtype_name: str) -> torch.dtype:
    if dtype_name == "U8" and name.endswith(_MXFP4_SUFFIXES):
        return torch.uint8  # MXFP4 experts (loader/mxfp4_hf.py)
    if dtype_name not in _FLOAT_DTYPES:
        raise ModelFormatError(
            f"tensor {name} in {file.name} has dtype {dtype_name}: Strata reads "
            "float32/float16/bfloat16 safetensors; use an unquantized model or a GGUF"
        )
    return _FLOAT_DTYPES[dtype_name]


def _damaged(file: Path, error: Exception) -> ModelFormatError:
    return ModelFormatError(f"{file} is truncated or damaged ({error}): download it again")


def _mapped_tensor(reader, file: Path, name: str, shape, dtype: torch.dtype) -> DeferredTensor:
    def read() -> torch.Tensor:
        try:
            return reader.get_tensor(name)  # a view of the mmapped file, no copy
        except SafetensorError as e:
            raise _damaged(file, e) from None

    return DeferredTensor(shape, dtype, read)


def _open_file(file: Path, tensors: dict[str, LazyTensor]) -> None:
    """Add the file's tensors to `tensors` from its header alone; safe_open mmaps the file and
    checks that the header's offsets cover it exactly (a truncated file fails here)."""
    try:
        reader = safe_open(str(file), framework="pt", device="cpu")
        for name in reader.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            header = reader.get_slice(name)
            dtype = _dtype_of(file, name, header.get_dtype())
            if name in tensors:
                raise ModelFormatError(
                    f"tensor {name} appears in more than one file of {file.parent}: "
                    "remove the stray .safetensors files"
                )
            tensors[name] = _mapped_tensor(reader, file, name, header.get_shape(), dtype)
    except SafetensorError as e:
        raise _damaged(file, e) from None


def open_hf_tensors(path: str | Path, config: ModelConfig) -> dict[str, LazyTensor]:
    """Every tensor of the directory, unread, in canonical names (sanitized), in file dtypes.

    The files stay mapped while any of the returned tensors lives.
    """
    module = model_module(config.model_type)
    tensors: dict[str, LazyTensor] = {}
    for file in safetensors_files(path):
        _open_file(file, tensors)
    return module.sanitize(tensors, config)


def load_hf_tensors(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the directory as float32 on the CPU, in canonical names (sanitized)."""
    return materialize(open_hf_tensors(path, config))
