"""ModelInfo for a GGUF file or a Hugging Face directory, from headers only (no tensor data)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from safetensors import SafetensorError, safe_open

from strata.engine.core.loader.gguf_names import GGUF_ARCHITECTURES
from strata.engine.core.loader.quant_plan import (
    VramEstimate,
    default_context_tokens,
    estimate_vram,
    kv_bytes,
)
from strata.engine.core.model_config import (
    SUPPORTED_MODEL_TYPES,
    ModelFormatError,
    hf_text_model_type,
)
from strata.engine.core.model_info import ModelInfo
from strata.engine.gguf_file import open_gguf
from strata.engine.gguf_reader import GGUFFile


def _is_block_past(gguf_name: str, num_layers: int) -> bool:
    """Whether a tensor belongs to a block at or past num_layers (an MTP block)."""
    parts = gguf_name.split(".")
    return parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= num_layers


def _gguf_vram(reader: GGUFFile, arch: str, context_tokens: int) -> VramEstimate | None:
    """What the file will hold on a GPU at context_tokens; None without the shape metadata."""
    layers = reader.metadata.get(f"{arch}.block_count")
    heads = reader.metadata.get(f"{arch}.attention.head_count")
    hidden = reader.metadata.get(f"{arch}.embedding_length")
    if not (layers and heads and hidden):
        return None
    kv_heads = reader.metadata.get(f"{arch}.attention.head_count_kv") or heads
    head_dim = reader.metadata.get(f"{arch}.attention.key_length") or int(hidden) // int(heads)
    # GLM's MTP blocks (nextn_predict_layers, past the decoder's) are skipped at load.
    layers = int(layers) - int(reader.metadata.get(f"{arch}.nextn_predict_layers") or 0)
    kv = kv_bytes(layers, int(kv_heads), int(head_dim), context_tokens)
    tensors = [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes),
                int(t.shape[-1]) if len(t.shape) > 1 else 1) for t in reader.tensors
               if not _is_block_past(t.name, layers)]
    return estimate_vram(tensors, kv)


def inspect_gguf(path: Path, context_tokens: int = 0) -> ModelInfo:
    """Info for a GGUF file; an unsupported architecture is reported, not refused.
    context_tokens: the context the VRAM estimate assumes (0: the engine's default)."""
    reader = open_gguf(path)
    arch = str(reader.metadata.get("general.architecture", "unknown"))
    model_type = GGUF_ARCHITECTURES.get(arch, arch)
    if arch == "llama" and (reader.metadata.get("llama.expert_count") or 0) > 0:
        model_type = "mixtral"
    template = reader.metadata.get("tokenizer.chat_template")
    model_context = int(reader.metadata.get(f"{arch}.context_length", 0) or 0)
    context_tokens = context_tokens or default_context_tokens(model_context)
    return ModelInfo(
        path=str(path),
        format="gguf",
        model_type=model_type,
        parameter_count=sum(int(t.n_elements) for t in reader.tensors),
        quant_types=dict(Counter(t.tensor_type.name for t in reader.tensors)),
        context_tokens=model_context,
        has_chat_template=bool(template),
        file_bytes=path.stat().st_size,
        is_supported=model_type in SUPPORTED_MODEL_TYPES,
        vram=_gguf_vram(reader, arch, context_tokens),
        vram_context_tokens=context_tokens,
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path} cannot be read as JSON ({e}): download it again") from None
    return data if isinstance(data, dict) else {}


def _has_hf_chat_template(directory: Path) -> bool:
    # transformers >= 4.43 may save the template beside tokenizer_config.json instead of in it.
    if (directory / "chat_template.jinja").is_file() or (
        directory / "chat_template.json"
    ).is_file():
        return True
    tokenizer_config = directory / "tokenizer_config.json"
    return tokenizer_config.is_file() and bool(_read_json(tokenizer_config).get("chat_template"))


def inspect_hf(directory: Path) -> ModelInfo:
    """Info for a Hugging Face directory (config.json + safetensors headers)."""
    from strata.engine.core.loader.hf import safetensors_files

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(
            f"config.json not found in {directory}: pass a .gguf file or a Hugging Face directory"
        )
    config = _read_json(config_path)
    parameter_count = 0
    dtypes: Counter[str] = Counter()
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    tensor_slice = f.get_slice(name)
                    numel = 1
                    for dim in tensor_slice.get_shape():
                        numel *= dim
                    parameter_count += numel
                    dtypes[tensor_slice.get_dtype()] += 1
        except SafetensorError as e:
            raise ModelFormatError(
                f"{file} is truncated or damaged ({e}): download it again"
            ) from None
    model_type = hf_text_model_type(config)
    text_config = config.get("text_config") or config
    return ModelInfo(
        path=str(directory),
        format="hf",
        model_type=model_type,
        parameter_count=parameter_count,
        quant_types=dict(dtypes),
        context_tokens=int(text_config.get("max_position_embeddings") or 0),
        has_chat_template=_has_hf_chat_template(directory),
        file_bytes=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
        is_supported=model_type in SUPPORTED_MODEL_TYPES,
    )
