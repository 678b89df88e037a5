"""GGUF (llama.cpp) models: config from metadata, tensors in HF layout, dequantized to float32
or, for weights that stay quantized, as their GGML blocks (GGUFBlocks)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from strata.engine.core.loader.gguf_names import (
    GGUF_ARCHITECTURES,
    IGNORED_GGUF_TENSORS,
    block_index,
    gguf_to_canonical,
    per_expert_target,
    unpermute_rope_rows,
)
from strata.engine.core.loader.gguf_rope import (
    llama3_scaling_from_freqs,
    rope_scaling_from_metadata,
)
from strata.engine.core.loader.lazy import (
    BlockTensor,
    DeferredTensor,
    LazyTensor,
    StackedTensor,
    materialize,
)
from strata.engine.core.loader.quant_plan import KERNEL_QUANT_TYPES
from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.gguf_file import open_gguf
from strata.engine.gguf_reader import GGUFFile, TensorInfo

# The types Strata reads: every type with a quantized kernel (quant_plan.py), plus floats; the
# CPU path dequantizes them with gguf-py (the kernels' test oracle). The gguf package knows a
# few more (TQ1_0, TQ2_0, NVFP4, ...), refused with a clear message instead.
SUPPORTED_QUANT_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", *KERNEL_QUANT_TYPES)
)

# Types torch reads straight from the mapped file, in their own dtype.
_NATIVE_DTYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
# qwen2/qwen3/glm4moe GGUFs keep HF's Q/K row order; mistral3's converter is llama's.
_ROPE_PERMUTED_ARCHS = ("llama", "mistral3")
# llama.cpp's converter writes Gemma's norm weights as 1 + w (convert_hf_to_gguf.py,
# Gemma3Model.norm_shift); the model applies (1 + w) itself, so the loader takes the 1 off.
_NORM_SHIFTED_ARCHS = ("gemma3",)
# llama.cpp's Gemma 3: every 6th layer global, local ones at RoPE base 10000 unscaled
# (llama-model.cpp, LLM_ARCH_GEMMA3: set_swa_pattern(6), rope_freq_base_train_swa).
_GEMMA3_SWA_PERIOD = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62  # whose queries llama.cpp scales by 1/sqrt(hidden / heads)
# Architectures whose converter appends multi-token-prediction blocks (skipped at load).
_MTP_ARCHS = ("glm4moe",)

log = logging.getLogger(__name__)


def _float32_value(value: float) -> float:
    """GGUF stores floats as float32; give back the short decimal it came from (1e-06, not
    9.99999997e-07) so configs compare equal to the HF ones."""
    return float(str(np.float32(value)))


def gguf_architecture(reader: GGUFFile, path: str | os.PathLike[str]) -> str:
    """The file's `general.architecture`, checked against the architectures Strata runs."""
    arch = reader.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFormatError(
            f"{path} has architecture {arch!r}, which Strata cannot run; supported GGUF "
            f"architectures: {', '.join(GGUF_ARCHITECTURES)} (Mixtral is llama with experts)"
        )
    return arch


def load_gguf_config(path: str | os.PathLike[str]) -> ModelConfig:
    """Build the ModelConfig from a GGUF file's metadata (and tensor names, for flags that
    llama.cpp infers from which tensors exist: biases, tied embeddings, dense layers)."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    prefix = arch + "."
    # Keys, then values: .items() would decode every array, the vocabulary included.
    meta = {key[len(prefix) :]: reader.metadata[key] for key in reader.metadata
            if key.startswith(prefix)}
    tensors = {t.name: t for t in reader.tensors}

    def required(key: str) -> Any:
        if key not in meta:
            raise ModelFormatError(
                f"{path} lacks metadata {prefix}{key}: the file is incomplete; download it again"
            )
        return meta[key]

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    # GLM's converter counts its multi-token-prediction layers as blocks past the decoder's.
    num_layers = int(required("block_count")) - int(meta.get("nextn_predict_layers") or 0)
    head_dim = int(meta.get("attention.key_length") or hidden // heads)
    rotary_dim = int(meta.get("rope.dimension_count") or head_dim)
    num_experts = int(meta.get("expert_count") or 0)
    model_type = "mixtral" if arch == "llama" and num_experts > 0 else GGUF_ARCHITECTURES[arch]
    rope_theta = float(meta.get("rope.freq_base", 10000.0))

    rope_scaling = rope_scaling_from_metadata(meta)
    if "rope_factors_long.weight" in tensors and "rope_factors_short.weight" in tensors:
        rope_scaling = _longrope_scaling(tensors, meta)
    elif rope_scaling is None and "rope_freqs.weight" in tensors:
        freqs_tensor = tensors["rope_freqs.weight"]
        freqs = dequantize_tensor(freqs_tensor.name, freqs_tensor.tensor_type, freqs_tensor.data)
        rope_scaling = llama3_scaling_from_freqs(freqs, rope_theta, head_dim)

    num_tokens = reader.metadata.array_len("tokenizer.ggml.tokens")
    embed_rows = int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else 0
    vocab_size = num_tokens if num_tokens is not None else embed_rows
    if embed_rows and vocab_size != embed_rows:
        raise ModelFormatError(
            f"{path} has {vocab_size} tokens but token_embd.weight has {embed_rows} rows: the "
            "file is inconsistent; download it again"
        )

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        # llama.cpp stops on any end-of-generation token; Llama 3 chat ends turns with eot.
        value = reader.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = reader.metadata.get("tokenizer.ggml.bos_token_id")

    sliding_window = int(meta.get("attention.sliding_window") or 0) if arch == "phi3" else 0
    dense_layers = tuple(
        i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
    )
    extra = _gemma3_fields(meta, num_layers, hidden // heads, head_dim) if arch == "gemma3" else {}
    # llama.cpp's gating function enum: 1 softmax, 2 sigmoid (GLM's, its default there).
    gating = int(meta.get("expert_gating_func") or (2 if arch == "glm4moe" else 1))
    if gating not in (1, 2):
        raise ModelFormatError(
            f"{path} uses expert gating function {gating}, which Strata does not run "
            "(softmax 1 and sigmoid 2 only)"
        )
    extra |= _gpt_oss_fields(meta, num_layers, rope_scaling) if arch == "gpt-oss" else {}
    extra |= _mistral3_fields(meta, path) if arch == "mistral3" else {}
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta.get("feed_forward_length") or 0),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_float32_value(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta.get("context_length") or 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        num_experts=num_experts,
        num_experts_per_tok=int(meta.get("expert_used_count") or 0),
        # Mixtral GGUFs have no expert length: its experts use feed_forward_length.
        moe_intermediate_size=int(
            meta.get("expert_feed_forward_length") or meta.get("feed_forward_length") or 0
        )
        if num_experts
        else 0,
        # llama.cpp renormalises the top-k weights of qwen3moe/mixtral unless told otherwise.
        norm_topk_prob=bool(meta.get("expert_weights_norm", True)) if num_experts else False,
        mlp_only_layers=dense_layers if num_experts else (),
        moe_scoring="sigmoid" if gating == 2 else "softmax",
        routed_scaling_factor=_float32_value(meta.get("expert_weights_scale") or 1.0),
        n_group=int(meta.get("expert_group_count") or 1),
        topk_group=int(meta.get("expert_group_used_count") or 1),
        n_shared_experts=int(meta.get("expert_shared_count") or 0) if num_experts else 0,
        use_qk_norm=arch == "glm4moe" and "blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=tuple(eos_ids),
        partial_rotary_factor=rotary_dim / head_dim,
        # Gemma 3's window is its local layers' (extra); Phi-3's is every layer's.
        **{"sliding_window": sliding_window or None, **extra},
    )


def _gemma3_fields(meta: dict[str, Any], num_layers: int, hidden_per_head: int,
                   head_dim: int) -> dict[str, Any]:
    """The Gemma 3 ModelConfig fields of a gemma3 GGUF, read as llama.cpp reads them: the
    window from metadata (none: every layer global), the rest fixed by llama.cpp."""
    window = int(meta.get("attention.sliding_window") or 0) or None
    layer_types = tuple(
        "sliding_attention" if window and (i + 1) % _GEMMA3_SWA_PERIOD else "full_attention"
        for i in range(num_layers))
    softcap = meta.get("final_logit_softcapping")
    return {
        "layer_types": layer_types,
        "sliding_window": window,
        "rope_local_theta": float(meta.get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)),
        "query_pre_attn_scalar": float(
            hidden_per_head if num_layers == _GEMMA3_27B_LAYERS else head_dim),
        "final_logit_softcapping": _float32_value(softcap) if softcap else None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _longrope_scaling(tensors: dict[str, TensorInfo], meta: dict[str, Any]) -> dict[str, Any]:
    """HF longrope rope_scaling from Phi-3/4's factor tensors and metadata (llama.cpp's
    converter writes the attention factor it derived; transformers would derive the same)."""
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for kind in ("short", "long"):
        info = tensors[f"rope_factors_{kind}.weight"]
        factors = dequantize_tensor(info.name, info.tensor_type, info.data).reshape(-1)
        scaling[f"{kind}_factor"] = [float(f) for f in factors]
    original = meta.get("rope.scaling.original_context_length") or meta.get("context_length")
    scaling["original_max_position_embeddings"] = int(original or 2048)
    if meta.get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(meta["rope.scaling.attn_factor"])
    return scaling


def _gpt_oss_fields(meta: dict[str, Any], num_layers: int,
                    rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """gpt-oss's fields the GGUF keeps implicit: llama.cpp slides the window on even layers
    and takes YaRN's beta_fast/slow and the clamped SwiGLU's alpha/limit as fixed constants;
    these are the values of OpenAI's config.json, truncate=False included, so a GGUF and the
    Hugging Face checkpoint it came from compute the same RoPE."""
    window = int(meta.get("attention.sliding_window") or 0)
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn":
        rope_scaling.update(beta_fast=float(meta.get("rope.scaling.yarn_beta_fast") or 32.0),
                            beta_slow=float(meta.get("rope.scaling.yarn_beta_slow") or 1.0),
                            truncate=False)
    return {
        "sliding_window": window,
        "layer_types": tuple("sliding_attention" if window and i % 2 == 0 else "full_attention"
                             for i in range(num_layers)),
    }


def _mistral3_fields(meta: dict[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """Ministral 3's query temperature: its beta is a key of its own, its period YaRN's original
    context, as llama.cpp reads them (llama_model_mistral3::load_arch_hparams)."""
    beta = float(meta.get("attention.temperature_scale") or 0.0)
    if not beta:
        return {}
    period = int(meta.get("rope.scaling.original_context_length") or 0)
    if period <= 0:
        raise ModelFormatError(
            f"{path} sets attention.temperature_scale but no rope.scaling."
            "original_context_length: the file is incomplete; convert it again")
    return {"llama4_scaling_beta": _float32_value(beta), "llama4_scaling_period_tokens": period}


def _check_quant_type(name: str, tensor_type: GGMLQuantizationType) -> None:
    if tensor_type not in SUPPORTED_QUANT_TYPES:
        raise ModelFormatError(
            f"tensor {name} uses quant type {tensor_type.name}, which Strata cannot dequantize; "
            "use a Q4_K_M, Q8_0 or F16 file"
        )


def dequantize_tensor(name: str, tensor_type: GGMLQuantizationType, data: np.ndarray) -> np.ndarray:
    """Dequantize one GGUF tensor's raw data to a writable float32 array in numpy order."""
    _check_quant_type(name, tensor_type)
    values = dequantize(data, tensor_type).astype(np.float32, copy=False)
    if not values.flags.writeable:
        # F32 comes back as a view of the read-only memmap; torch needs its own writable copy.
        values = values.copy()
    return values


class GGUFBlocks(BlockTensor):
    """A quantized GGUF tensor: read() dequantizes it to float32 like any DeferredTensor, and
    `read_blocks()` gives its GGML blocks as stored, uint8 [..., rows, row_bytes] (llama Q/K rows
    un-permuted: a row's blocks move with it), for weights that stay quantized."""

    def __init__(self, tensor: TensorInfo, shape: tuple[int, ...], rope_heads: int | None,
                 make, blocks=None):
        # blocks: a part's (rows_of); else the file's, a view of the mapped file.
        super().__init__(shape, tensor.tensor_type, blocks or self._file_blocks)
        self._make = make  # dequantized by gguf-py, llama rows un-permuted
        self.source_name = tensor.name
        self.gguf_name = tensor.name
        self._tensor = tensor
        self._rope_heads = rope_heads

    def _file_blocks(self) -> torch.Tensor:
        blocks = self._tensor.data.reshape(*self.shape[:-1], -1)
        if self._rope_heads is not None:
            blocks = np.ascontiguousarray(unpermute_rope_rows(blocks, self._rope_heads))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(blocks)

    def rows_of(self, index: torch.Tensor) -> GGUFBlocks:
        """These rows (lazy.rows_of), still in blocks: a fused tensor's part, or reordered
        rows. Whole rows are whole blocks, so any row split is block-aligned."""
        shape = (int(index.numel()), *self.shape[1:])
        return GGUFBlocks(self._tensor, shape, self._rope_heads,
                          lambda: self.read()[index], blocks=lambda: self.read_blocks()[index])


def _gguf_tensor(tensor: TensorInfo, rope_heads: int | None) -> DeferredTensor:
    """One GGUF tensor, read when asked for: F32/F16 as views of the mapped file in their own
    dtype, other types dequantized to float32 (GGUFBlocks, which also gives the blocks as
    stored); llama Q/K rows un-permuted (rope_heads)."""
    shape = tuple(reversed(tensor.shape))  # GGUF lists ne[0] first
    native_dtype = _NATIVE_DTYPES.get(tensor.tensor_type)

    def read() -> torch.Tensor:
        if native_dtype is None:
            values = dequantize_tensor(tensor.name, tensor.tensor_type, tensor.data)
        else:
            values = tensor.data
        values = values.reshape(shape)
        if rope_heads is not None:
            values = np.ascontiguousarray(unpermute_rope_rows(values, rope_heads))
        with warnings.catch_warnings():
            # A view of the read-only memmap: it is only ever copied from (see lazy.py).
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(values)

    if native_dtype is None and tensor.tensor_type != GGMLQuantizationType.BF16:
        return GGUFBlocks(tensor, shape, rope_heads, read)
    return DeferredTensor(shape, native_dtype or torch.float32, read, tensor.name)


def _norm_unshifted(tensor: DeferredTensor) -> DeferredTensor:
    """A Gemma norm weight stored as 1 + w, read as w (float32: 1 + w is exact there)."""
    return DeferredTensor(tensor.shape, torch.float32, lambda: tensor.read().float() - 1.0,
                          tensor.source_name)


def _log_projector_beside(path: str | os.PathLike[str]) -> None:
    """One log line where a multimodal model's projector file (llama.cpp's mmproj-*.gguf)
    lies beside the text model: Strata loads the text part only."""
    projectors = sorted(p.name for p in Path(path).parent.glob("*.gguf")
                        if "mmproj" in p.name.lower() and p.name != Path(path).name)
    if projectors:
        log.info("%s has a vision projector beside it (%s): loading the text model only; "
                 "Strata does not read images", Path(path).name, ", ".join(projectors))


def open_gguf_tensors(path: str | os.PathLike[str], config: ModelConfig) -> dict[str, LazyTensor]:
    """All tensors of a GGUF file, unread, in canonical (HF) names and layouts: Linear weights
    [out, in], stacked experts [E, out, in], llama Q/K un-permuted, Gemma norms un-shifted.
    Each is dequantized (or, for F32/F16, viewed in the mapped file) only when read."""
    reader = open_gguf(path)
    arch = gguf_architecture(reader, path)
    _log_projector_beside(path)
    to_canonical = gguf_to_canonical(arch, config)
    out: dict[str, LazyTensor] = {}
    per_expert: dict[str, dict[int, LazyTensor]] = {}
    mtp_tensors = 0
    for t in reader.tensors:
        if t.name in IGNORED_GGUF_TENSORS:
            continue
        block = block_index(t.name)
        if arch in _MTP_ARCHS and block is not None and block >= config.num_hidden_layers:
            mtp_tensors += 1  # a next-token-prediction block (nextn_predict_layers)
            continue
        stacked = per_expert_target(t.name)
        canonical = to_canonical.get(t.name)
        if canonical is None and stacked is None:
            raise ModelFormatError(
                f"{path} has tensor {t.name}, which a {config.model_type} model with this "
                "config does not use: the file does not match its metadata"
            )
        _check_quant_type(t.name, t.tensor_type)
        if stacked is not None:
            per_expert.setdefault(stacked[0], {})[stacked[1]] = _gguf_tensor(t, None)
            continue
        rope_heads = None
        is_q, is_k = ".self_attn.q_proj." in canonical, ".self_attn.k_proj." in canonical
        if arch in _ROPE_PERMUTED_ARCHS and (is_q or is_k):
            rope_heads = config.num_attention_heads if is_q else config.num_key_value_heads
        out[canonical] = _gguf_tensor(t, rope_heads)
        if arch in _NORM_SHIFTED_ARCHS and canonical.endswith("norm.weight"):
            out[canonical] = _norm_unshifted(out[canonical])
    for name, experts in per_expert.items():
        out[name] = StackedTensor([experts[e] for e in sorted(experts)])
    if mtp_tensors:
        log.info("%s: skipping %d tensors of the MTP (next-token prediction) blocks from blk.%d: "
                 "not used for decoding", path, mtp_tensors, config.num_hidden_layers)

    missing = [name for name in to_canonical.values() if name not in out]
    if missing:
        gguf_name = next(g for g, c in to_canonical.items() if c == missing[0])
        raise ModelFormatError(
            f"{path} lacks tensor {gguf_name} ({len(missing)} missing in all): the file is "
            "incomplete or its metadata is wrong; download it again"
        )
    return out


def load_gguf_tensors(path: str | os.PathLike[str], config: ModelConfig) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file dequantized to float32 on CPU, in canonical names and layouts
    (see open_gguf_tensors)."""
    return materialize(open_gguf_tensors(path, config))
