"""The registry of a loaded model's arenas, by name, with the byte accounting /v1/status shows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from strata.engine.core.memory.arena import Arena


class ArenaSet:
    """Every arena of one engine by name (weights, experts, kv, ...)."""

    def __init__(self) -> None:
        self._arenas: dict[str, Arena] = {}

    def add(self, arena: Arena) -> Arena:
        """Register an arena; names are unique so status keys never collide."""
        if arena.name in self._arenas:
            raise ValueError(f"an arena named {arena.name!r} is already registered")
        self._arenas[arena.name] = arena
        return arena

    def __getitem__(self, name: str) -> Arena:
        try:
            return self._arenas[name]
        except KeyError:
            raise KeyError(
                f"no arena named {name!r}; registered: {', '.join(self._arenas) or 'none'}"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._arenas

    def __iter__(self) -> Iterator[Arena]:
        return iter(list(self._arenas.values()))

    def __len__(self) -> int:
        return len(self._arenas)

    def status(self) -> dict[str, Any]:
        """Plain values: per arena state and bytes, and the totals over all of them."""
        arenas = {
            a.name: {
                "state": a.state,
                "device": str(a.device),
                "reserved_bytes": a.reserved_bytes,
                "resident_bytes": a.resident_bytes,
                "released_bytes": a.released_bytes,
                "allocated_bytes": a.allocated_bytes,
                "has_host_copy": a.host_copy is not None,
            }
            for a in self._arenas.values()
        }
        totals = {
            key: sum(a[key] for a in arenas.values())
            for key in ("reserved_bytes", "resident_bytes", "released_bytes")
        }
        return {"arenas": arenas, "totals": totals}

    def release_all(self) -> int:
        """Release every arena (sleep); returns the bytes freed."""
        return sum(a.release() for a in self._arenas.values())

    def close(self) -> None:
        """Close every arena and forget them (unload)."""
        for arena in self._arenas.values():
            arena.close()
        self._arenas.clear()
