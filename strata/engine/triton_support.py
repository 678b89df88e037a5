"""Whether the engine will have Triton here, told without importing torch or Triton.

On Windows PyTorch does not pull Triton (the `triton-windows` package provides it); without it
the engine expands every GGUF block to bf16 at load (3-4x the VRAM) and the fast kernels are
off. The host sizes loads by this (load_size.py) and shows the notice in its status; the engine
says the same at load, from what it could really import (quant/weight.py).
"""

from __future__ import annotations

import importlib.util
import os

NO_TRITON_NOTICE = (
    "Triton is not available: GGUF weights are expanded to bf16 at load (3-4x the VRAM) and "
    "the fast kernels are off; install triton-windows (Windows) or triton (Linux)"
)


def triton_installed() -> bool:
    """Whether `import triton` can find the package (no import: it takes seconds)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken install or a module without a spec
        return False


def keeps_quantized_on_gpu() -> bool:
    """Whether GGUF blocks stay quantized on a CUDA device: Triton installed and
    STRATA_QUANTIZED not 0 (the engine's own rule: quant/weight.keeps_quantized_blocks)."""
    return os.environ.get("STRATA_QUANTIZED") != "0" and triton_installed()


def gpu_kernel_notice(device: str) -> str | None:
    """The one-line notice for a load on `device` (auto, cuda, cpu) when Triton is missing;
    None when it is installed, or on the CPU, where blocks are expanded anyway."""
    if device == "cpu" or triton_installed():
        return None
    return NO_TRITON_NOTICE
