"""What `strata info` shows about a model file, gathered without loading or dequantizing it."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.engine.core.loader.quant_plan import VramEstimate


@dataclass(frozen=True)
class ModelInfo:
    """A model file's identity and size, from metadata and tensor shapes only."""

    path: str
    format: str  # "gguf" | "hf"
    model_type: str  # Strata's model_type, or the file's own architecture name if unsupported
    parameter_count: int
    # GGML type name (GGUF) or safetensors dtype (HF) -> number of tensors stored that way.
    quant_types: dict[str, int] = field(default_factory=dict)
    context_tokens: int = 0
    has_chat_template: bool = False
    file_bytes: int = 0
    is_supported: bool = True  # False when Strata cannot run this architecture
    vram: VramEstimate | None = None  # on a GPU, at vram_context_tokens (GGUF files only)
    vram_context_tokens: int = 0


def _human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def runnable_text(file_format: str) -> str:
    """The architectures Strata runs, named as a file of this format names them."""
    from strata.engine.core.loader.gguf_names import GGUF_ARCHITECTURES
    from strata.engine.core.model_config import SUPPORTED_MODEL_TYPES, TEXT_CONFIG_WRAPPERS

    if file_format == "gguf":
        return ("GGUF architectures " + ", ".join(sorted(GGUF_ARCHITECTURES))
                + " (llama with experts: Mixtral); see docs/models.md")
    names = sorted({*SUPPORTED_MODEL_TYPES, "gemma3", *TEXT_CONFIG_WRAPPERS})
    return "model_type " + ", ".join(names) + "; see docs/models.md"


def format_model_info(info: ModelInfo) -> str:
    """Multi-line, aligned text for `strata info` (no trailing newline)."""
    # Most-used type first: that is what people call the file's quantization (Q4_K, F16, ...).
    types = sorted(info.quant_types.items(), key=lambda kv: (-kv[1], kv[0]))
    arch = info.model_type if info.is_supported else f"{info.model_type} (not supported by Strata)"
    rows = [
        ("path", info.path),
        ("format", "GGUF" if info.format == "gguf" else "Hugging Face directory"),
        ("architecture", arch),
        ("parameters", f"{_human_count(info.parameter_count)} ({info.parameter_count:,})"),
        ("tensor types", ", ".join(f"{name} x{count}" for name, count in types) or "none"),
        ("context", f"{info.context_tokens:,} tokens" if info.context_tokens else "unknown"),
        ("chat template", "yes" if info.has_chat_template else "no"),
        ("size on disk", _human_bytes(info.file_bytes)),
    ]
    if not info.is_supported:
        rows.append(("Strata runs", runnable_text(info.format)))
    if info.vram is not None:
        v = info.vram
        rows.append(("VRAM on a GPU", (
            f"{_human_bytes(v.total_bytes)}: weights {_human_bytes(v.weights_bytes)} "
            f"({v.quantized_tensors} tensors kept in GGML blocks, the rest bf16), KV "
            f"{_human_bytes(v.kv_bytes)} at {info.vram_context_tokens:,} tokens, workspace "
            f"{_human_bytes(v.workspace_bytes)}")))
    width = max(len(label) for label, _ in rows) + 1
    return "\n".join(f"{label + ':':<{width}} {value}" for label, value in rows)
