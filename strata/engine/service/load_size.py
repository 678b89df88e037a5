"""The VRAM a load, wake or refill will map, computed on the host without torch.

A load maps the weights as the engine will hold them: GGUF blocks stay quantized where the
engine has Triton and a kernel for their type, and are expanded to bf16 where not (Windows
without triton-windows: triton_support.py); Hugging Face floats become bf16; the expert
cache per its policy (auto and N slots start from what the engine's own sizing needs at
least: one sparse layer's experts, plus the engine's 2 GiB auto reserve), and a workspace for
the CUDA context, cuBLAS and the first activations. A wake or refill maps what the engine
reports as released. The guard compares these with free VRAM minus --min-free-vram-mib
(vram_guard.py), so a load that cannot fit is refused before any process is spawned.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.engine.core.loader.quant_plan import COMPUTE_ITEMSIZE_BYTES, keeps_blocks
from strata.engine.triton_support import keeps_quantized_on_gpu
from strata.units import GIB, MIB

log = logging.getLogger(__name__)

LOAD_WORKSPACE_BYTES = 768 * MIB  # CUDA context (~500 MiB), cuBLAS workspace, activations
COME_BACK_WORKSPACE_BYTES = 256 * MIB  # activations of the first forward after a wake/refill
AUTO_EXPERT_RESERVE_BYTES = 2 * GIB  # residency.EXPERT_RESERVE_BYTES, left free by auto
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class StoredSize:
    """A model's tensor bytes as they will sit on the GPU, dense and experts apart."""

    dense_bytes: int
    expert_bytes: int
    num_sparse_layers: int = 0
    num_experts: int = 0  # per sparse layer

    def expert_cache_bytes(self, policy: str) -> int:
        """Bytes the expert cache maps at load under --expert-cache policy (at least)."""
        policy = str(policy).strip().lower()
        if not self.expert_bytes or policy == "off":
            return 0
        if policy == "all":
            return self.expert_bytes
        total_experts = max(1, self.num_sparse_layers * self.num_experts)
        per_expert = self.expert_bytes / total_experts
        one_layer = int(per_expert * max(1, self.num_experts))
        if policy.isdigit():
            return int(per_expert * max(int(policy), self.num_experts or 1))
        for unit, scale in (("gib", GIB), ("mib", MIB)):
            if policy.endswith(unit):
                return max(one_layer, min(self.expert_bytes, int(float(policy[:-3]) * scale)))
        # auto: the engine fills free VRAM minus its reserve, with one layer's experts at least
        return min(self.expert_bytes, one_layer + AUTO_EXPERT_RESERVE_BYTES)


def _gguf_size(path: Path, keeps_quantized: bool) -> StoredSize:
    from strata.engine.gguf_file import open_gguf  # numpy + gguf constants, no torch

    reader = open_gguf(path)
    arch = reader.metadata.get("general.architecture", "")
    # GLM's converter appends MTP blocks past the decoder's; the engine skips them.
    num_layers = int(reader.metadata.get(f"{arch}.block_count", 0) or 0) - int(
        reader.metadata.get(f"{arch}.nextn_predict_layers", 0) or 0)
    dense = experts = 0
    sparse_layers: set[str] = set()
    for tensor in reader.tensors:
        block = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else ""
        if block.isdigit() and int(block) >= num_layers > 0:
            continue
        # As quant_plan.estimate_vram: kept blocks as stored, the rest in bf16.
        if keeps_quantized and keeps_blocks(tensor.name, tensor.tensor_type.name):
            num_bytes = int(tensor.n_bytes)
        else:
            num_bytes = int(tensor.n_elements) * COMPUTE_ITEMSIZE_BYTES
        if "_exps." in tensor.name:
            experts += num_bytes
            sparse_layers.add(tensor.name.split(".")[1])
        else:
            dense += num_bytes
    num_experts = int(reader.metadata.get(f"{arch}.expert_count", 0) or 0)
    return StoredSize(dense, experts, len(sparse_layers), num_experts)


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _is_mtp_layer(name: str, num_layers: int) -> bool:
    """A tensor of a layer past num_hidden_layers (GLM's MTP layer; dropped at load)."""
    parts = name.split(".")
    return (num_layers > 0 and len(parts) > 2 and parts[:2] == ["model", "layers"]
            and parts[2].isdigit() and int(parts[2]) >= num_layers)


def _hf_size(directory: Path) -> StoredSize:
    config: Mapping[str, Any] = {}
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        pass
    num_layers = int(config.get("num_hidden_layers") or 0)
    dense = experts = 0
    sparse_layers: set[str] = set()
    for file in sorted(directory.glob("*.safetensors")):
        for name, entry in _safetensors_header(file).items():
            if name == "__metadata__" or _is_mtp_layer(name, num_layers):
                continue
            begin, end = entry["data_offsets"]
            itemsize = _FLOAT_BYTES.get(entry.get("dtype", ""), 0)
            # Floats become bf16 on the GPU; other dtypes are mapped as stored.
            num_bytes = (end - begin) * 2 // itemsize if itemsize > 2 else end - begin
            if ".experts." in name:
                experts += num_bytes
                sparse_layers.add(name.split(".experts.")[0])
            else:
                dense += num_bytes
    num_experts = int(config.get("num_experts") or config.get("num_local_experts")
                      or config.get("n_routed_experts") or 0)
    return StoredSize(dense, experts, len(sparse_layers), num_experts)


def stored_size(model_path: str, keeps_quantized: bool | None = None) -> StoredSize | None:
    """The model's StoredSize on a GPU, or None when it cannot be told (random weights,
    unreadable). keeps_quantized: whether GGUF blocks stay quantized (default: whether the
    engine will have Triton here, triton_support.keeps_quantized_on_gpu)."""
    if keeps_quantized is None:
        keeps_quantized = keeps_quantized_on_gpu()
    path = Path(model_path)
    try:
        if path.is_dir():
            return _hf_size(path)
        if path.is_file():
            return _gguf_size(path, keeps_quantized)
    except Exception as exc:  # noqa: BLE001 - a model the loader will refuse with its own words
        log.debug("cannot size %s for the VRAM guard: %s", model_path, exc)
    return None


def random_weights_size(config_path: str) -> StoredSize | None:
    """The bf16 bytes of a --random-weights config.json (Llama / Qwen3-MoE shapes); None for
    a preset name (its table lives with torch, in the engine)."""
    try:
        config = json.loads(Path(config_path).read_text())
    except (OSError, ValueError):
        return None
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // int(config["num_attention_heads"]))
    q_dim = int(config["num_attention_heads"]) * head_dim
    kv_dim = int(config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim
    embed = int(config["vocab_size"]) * hidden * (1 if config.get("tie_word_embeddings") else 2)
    attention = hidden * (2 * q_dim + 2 * kv_dim)
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts:
        mlp = hidden * num_experts  # the router
        experts = layers * num_experts * 3 * hidden * int(config["moe_intermediate_size"])
    else:
        mlp, experts = 3 * hidden * int(config["intermediate_size"]), 0
    dense = embed + layers * (attention + mlp)
    return StoredSize(2 * dense, 2 * experts, layers if num_experts else 0, num_experts)


def load_bytes(engine_config: Any) -> int:
    """Bytes a load of engine_config maps: weights, expert cache per policy, workspace; 0 when
    the model cannot be sized on the host: the reserve alone guards it then."""
    if str(getattr(engine_config, "device", "auto")) == "cpu":
        return 0
    random_config = getattr(engine_config, "random_weights", None)
    if random_config:
        size = random_weights_size(str(random_config))
    else:
        size = stored_size(str(getattr(engine_config, "model_path", "")))
    if size is None:
        return 0
    policy = str(getattr(engine_config, "expert_cache", "auto"))
    return size.dense_bytes + size.expert_cache_bytes(policy) + LOAD_WORKSPACE_BYTES


def released_bytes(engine_info: Mapping[str, Any], arenas: tuple[str, ...]) -> int:
    """Bytes the engine reports released in the named arenas (what a wake/refill maps back)."""
    found = engine_info.get("arenas") or {}
    return sum(int((found.get(name) or {}).get("released_bytes") or 0) for name in arenas)
