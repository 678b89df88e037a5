"""GGUF expert blocks in the forms torch's CPU kernels take (issue 54's CPU-computed miss).

The conversions are strata's own (strata/engine/core/quant/cpu_experts.py: Q4_K exactly to
int4 groups of 32 for _weight_int4pack_mm_for_cpu, other types requantized to int8 per row
for _weight_int8pack_mm); this file re-exports them for the benches and adds the byte
counts diag_cpu_expert.py reports.
"""

from __future__ import annotations

from strata.engine.core.quant.cpu_experts import (
    INNER_K_TILES,
    INT4_GROUP,
    Int4Groups,
    dequantized,
    gguf_bytes,
    q4k_to_int4,
    to_int8_rows,
)

__all__ = ["INNER_K_TILES", "INT4_GROUP", "Int4Groups", "dequantized", "gguf_bytes",
           "int4_bytes", "int8_bytes", "q4k_to_int4", "to_int8_rows"]


def int4_bytes(rows: int, cols: int, scale_bytes: int = 2) -> int:
    """Host bytes of an int4-packed matrix: nibbles plus a scale and zero per group."""
    return rows * cols // 2 + 2 * scale_bytes * rows * cols // INT4_GROUP


def int8_bytes(rows: int, cols: int, scale_bytes: int = 2) -> int:
    """Host bytes of a per-row int8 matrix."""
    return rows * cols + scale_bytes * rows
