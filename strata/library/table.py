"""The library as a table, for `strata list`."""

from __future__ import annotations

from collections.abc import Sequence

from strata.library.catalog import ModelEntry


def _size(entry: ModelEntry) -> str:
    if not entry.is_downloaded:
        return "not downloaded"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if entry.size_bytes >= scale:
            return f"{entry.size_bytes / scale:.1f} {unit}"
    return f"{entry.size_bytes} B"


def format_table(entries: Sequence[ModelEntry]) -> str:
    """NAME, SIZE, FORMAT, QUANT, CONTEXT; the default model is marked."""
    rows = [("NAME", "SIZE", "FORMAT", "QUANT", "CONTEXT")]
    for e in entries:
        rows.append((e.name + (" (default)" if e.is_default else ""), _size(e), e.format,
                     e.quantization or "-", str(e.context_tokens or "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
