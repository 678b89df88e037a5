"""shrink_experts on the host: size the engine's expert cache so N MiB of VRAM stay free for
another program, keep serving from the partial cache, and grow back as VRAM frees.

The engine resizes to a slot count (protocol ResizeExperts); this module turns "keep N MiB
free" into that count from NVML's free VRAM and the cache's bytes per expert. Slots are freed
in whole arena chunks, so a first resize may free a little less than asked: it then tries
again, at most a few times. While a target is set, `grow_step` (called by the lifecycle's
grower task every GROW_INTERVAL_S) maps slots back whenever free VRAM exceeds the target.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypedDict

from strata.engine import protocol as p
from strata.engine.service.facade import ServiceError
from strata.units import MIB

log = logging.getLogger(__name__)

GROW_INTERVAL_S = 1.0
MAX_SHRINK_ROUNDS = 3

Command = Callable[[Any], Awaitable[Any]]


class CacheInfo(TypedDict):
    num_slots: int
    max_slots: int
    bytes_per_expert: int
    mode: str | None  # "slots" for a partial cache that can be resized


def cache_info(experts: Mapping[str, Any] | None) -> CacheInfo | None:
    """{num_slots, max_slots, bytes_per_expert, mode} of a partial expert cache (the
    engine status' experts), or None."""
    if not isinstance(experts, Mapping) or not experts.get("bytes_per_expert"):
        return None
    max_slots = int(experts.get("max_slots") or experts.get("num_slots") or 0)
    return {"num_slots": int(experts.get("num_slots") or max_slots), "max_slots": max_slots,
            "bytes_per_expert": int(experts["bytes_per_expert"]),
            "mode": experts.get("mode")}


SHRINKABLE_MODES = ("slots", "all")  # all: a cache holding every expert switches live


def can_shrink(experts: Mapping[str, Any] | None) -> bool:
    """Whether shrink_experts applies to this expert cache (the engine status' experts): the
    one rule the service's shrink and the tray's menu item both follow."""
    return isinstance(experts, Mapping) and experts.get("mode") in SHRINKABLE_MODES


def slots_to_free(deficit_bytes: int, bytes_per_expert: int) -> int:
    """Slots whose release covers deficit_bytes."""
    return max(0, math.ceil(deficit_bytes / bytes_per_expert))


class ExpertShrinker:
    """Drives ResizeExperts for a keep-free target; the lifecycle owns the lane and status."""

    def __init__(self, read_free_bytes: Callable[[], Awaitable[int | None]]):
        self.read_free_bytes = read_free_bytes
        self.keep_free_bytes: int | None = None  # the target while shrunk; None: not shrunk

    async def shrink(self, command: Command, experts: Mapping[str, Any] | None,
                     keep_free_bytes: int) -> dict[str, Any]:
        """Resize so keep_free_bytes are free (as far as a partial cache can go); `experts`:
        the engine status' expert cache now. `command` keeps the status its replies carry."""
        info = cache_info(experts)
        if info is None or not can_shrink(experts):
            raise ServiceError("not_applicable", "shrink experts does not apply: the "
                               "model has no expert cache (a dense model, or the cache off "
                               "with --expert-cache off)")
        self.keep_free_bytes = keep_free_bytes
        freed_bytes, rounds = 0, 0
        result: dict[str, Any] = {}
        while rounds < MAX_SHRINK_ROUNDS:
            free_bytes = await self.read_free_bytes()
            if free_bytes is None:
                raise ServiceError("not_applicable", "shrink experts needs NVML to see "
                                   "free VRAM; use release_experts instead")
            deficit = keep_free_bytes - free_bytes
            if deficit <= 0 or info["num_slots"] <= 0:
                break
            target = info["num_slots"] - slots_to_free(deficit, info["bytes_per_expert"])
            reply = await command(p.ResizeExperts(max(target, 1)))
            result = dict(reply.result)
            freed_bytes += int(result.get("freed_bytes") or 0)
            rounds += 1
            if int(result.get("num_slots", info["num_slots"])) >= info["num_slots"]:
                break  # at its floor (one layer's experts): nothing more to give
            info = {**info, "num_slots": int(result["num_slots"])}
        free_after = await self.read_free_bytes()
        return {"changed": rounds > 0 and freed_bytes > 0, "freed_bytes": freed_bytes,
                "num_slots": info["num_slots"], "max_slots": info["max_slots"],
                "keep_free_mib": keep_free_bytes // MIB,
                "free_mib": None if free_after is None else free_after // MIB,
                "is_target_met": free_after is not None and free_after >= keep_free_bytes}

    async def grow_step(self, command: Command, experts: Mapping[str, Any] | None) -> bool:
        """Map back as many slots as leave the target free; True when the cache is whole
        again (the grower can stop)."""
        cache = cache_info(experts)
        if cache is None or self.keep_free_bytes is None:
            return True
        if cache["num_slots"] >= cache["max_slots"]:
            self.keep_free_bytes = None
            return True
        free_bytes = await self.read_free_bytes()
        if free_bytes is None:
            return False
        room = free_bytes - self.keep_free_bytes
        more = room // cache["bytes_per_expert"]
        if more <= 0:
            return False
        target = min(cache["max_slots"], cache["num_slots"] + int(more))
        try:
            await command(p.ResizeExperts(target))
        except Exception as exc:  # noqa: BLE001 - VRAM went again: try on the next tick
            log.info("growing the expert cache back to %d slots failed: %s", target, exc)
            return False
        log.info("expert cache grew back to %d of %d slots", target, cache["max_slots"])
        if target >= cache["max_slots"]:
            self.keep_free_bytes = None
            return True
        return False

    def clear(self) -> None:
        self.keep_free_bytes = None

