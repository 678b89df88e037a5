"""What the tray and the dashboard say about a partial expert cache (issue 54): one summary
line and a row a MoE layer, from the engine's `experts` status (ExpertStore.status), Qt-free.

Shown only while the cache holds fewer experts than the model has: all resident, nothing
misses, and a line of 100% hits would be noise."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata.app.menu_model import gib_text
from strata.units import GIB, MIB

LAYER_COLUMNS = ("Layer", "Hits", "Misses", "Hit rate", "Copied", "Read in place", "On CPU")


def partial_cache(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The expert cache's counters where it is partial (some experts have no slot), else None."""
    experts = status.get("experts")
    if not isinstance(experts, Mapping) or experts.get("is_all_resident", True):
        return None
    return experts


def size_text(num_bytes: int) -> str:
    """MiB below a GiB, GiB from there (the per-layer columns span both)."""
    return gib_text(num_bytes) if num_bytes >= GIB else f"{num_bytes / MIB:.0f} MiB"


def rate_text(hits: int, misses: int) -> str:
    """hits / (hits + misses) as a percentage, "-" before the first lookup."""
    lookups = hits + misses
    return f"{100.0 * hits / lookups:.1f}%" if lookups else "-"


def summary_line(status: Mapping[str, Any]) -> str | None:
    """"Experts: 2,817 of 6,144 resident · 74.5% hits · 1.2 GiB copied, 3.4 GiB read in place
    · 512 computed on the CPU", or None without a partial cache."""
    experts = partial_cache(status)
    if experts is None:
        return None
    line = (f"Experts: {int(experts.get('num_resident', 0)):,} of "
            f"{int(experts.get('total_experts', 0)):,} resident · "
            f"{rate_text(int(experts.get('num_hits', 0)), int(experts.get('num_misses', 0)))}"
            f" hits · {size_text(int(experts.get('copied_bytes', 0)))} copied, "
            f"{size_text(int(experts.get('host_read_bytes', 0)))} read in place")
    if "cpu_expert_misses" in experts:  # the CPU-computed misses are on (on or auto)
        line += f" · {int(experts.get('num_cpu_experts', 0)):,} computed on the CPU"
    return line


def layer_rows(status: Mapping[str, Any]) -> list[tuple[str, ...]]:
    """One row of LAYER_COLUMNS a MoE layer of a partial cache; none without one."""
    experts = partial_cache(status)
    if experts is None:
        return []
    rows: list[tuple[str, ...]] = []
    for layer in experts.get("layers") or ():
        hits, misses = int(layer.get("num_hits", 0)), int(layer.get("num_misses", 0))
        rows.append((str(layer.get("layer")), f"{hits:,}", f"{misses:,}",
                     rate_text(hits, misses), size_text(int(layer.get("copied_bytes", 0))),
                     size_text(int(layer.get("host_read_bytes", 0))),
                     f"{int(layer.get('num_cpu_experts', 0)):,}"))
    return rows
