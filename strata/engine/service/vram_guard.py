"""The free-VRAM guard: before a load, wake or refill, wait until what it maps fits.

The step's own bytes (load_size.py: weights as stored, the expert cache per its policy,
workspace; or what a wake/refill maps back) plus --min-free-vram-mib as a reserve must be free.
Another app (a game, ComfyUI) may still be letting go of its memory when the model comes back;
waiting a few seconds for it beats failing a map half-way. Past the wait the answer is a 503
with Retry-After and the MiB missing, and nothing has changed: the level stays where it was.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from strata.engine.core.memory.vram import read_free_vram_bytes  # NVML only, no torch
from strata.engine.service.facade import ServiceError
from strata.units import MIB

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
# What a client is told to wait before retrying: long enough for an app to finish exiting.
RETRY_AFTER_S = 5.0

FreeVramReader = Callable[[], "int | None"]


class VramGuard:
    """Waits for `min_free_vram_mib` of free VRAM, reading it through `reader` (NVML).

    A reader answering None (no NVML, no NVIDIA GPU) refuses nothing: there is nothing to
    wait on, and the engine's own mapping still fails cleanly if memory runs out.
    """

    def __init__(
        self,
        min_free_vram_mib: int = 0,
        wait_s: float = 15.0,
        *,
        reader: FreeVramReader = read_free_vram_bytes,
        poll_interval_s: float = POLL_INTERVAL_S,
    ):
        self.min_free_vram_mib = min_free_vram_mib
        self.wait_s = wait_s
        self.reader = reader
        self.poll_interval_s = poll_interval_s
        self.last_free_bytes: int | None = None  # the latest reading, for status()
        self.waiting: dict | None = None  # {what, need_bytes, free_bytes} while short

    @property
    def is_enabled(self) -> bool:
        """The reserve alone guards (steps of unknown size); sized steps are always checked."""
        return self.min_free_vram_mib > 0

    async def read_free_bytes(self) -> int | None:
        """Free VRAM now (NVML, off the loop), or None when it cannot be read."""
        return await self._read()

    async def _read(self) -> int | None:
        # NVML calls block for a moment (the first one initializes the library): off the loop.
        free_bytes = await asyncio.to_thread(self.reader)
        self.last_free_bytes = None if free_bytes is None else int(free_bytes)
        return self.last_free_bytes

    async def wait_for_room(self, what: str, need_bytes: int = 0,
                            wait_s: float | None = None) -> int | None:
        """Return once need_bytes plus the reserve are free (the bytes free, or None unknown).

        `what` names the step for the message ("load the model", "wake"); wait_s overrides
        the configured wait (0: look once, as a rule's restore does between its retries).
        Raises ServiceError("insufficient_vram") with retry_after_s when it never fits.
        """
        total_bytes = max(0, int(need_bytes)) + self.min_free_vram_mib * MIB
        if total_bytes <= 0:
            return None
        wait_s = self.wait_s if wait_s is None else wait_s
        deadline_s = time.monotonic() + wait_s
        has_logged = False
        while True:
            free_bytes = await self._read()
            if free_bytes is None or free_bytes >= total_bytes:
                self.waiting = None
                return free_bytes
            self.waiting = {"what": what, "need_bytes": total_bytes, "free_bytes": free_bytes}
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise self._refusal(what, need_bytes, total_bytes, free_bytes, wait_s)
            if not has_logged:
                log.info("waiting up to %.0f s for %d MiB of free VRAM before I %s (%d MiB free)",
                         wait_s, math.ceil(total_bytes / MIB), what, free_bytes // MIB)
                has_logged = True
            await asyncio.sleep(min(self.poll_interval_s, remaining_s))

    def _refusal(self, what: str, need_bytes: int, total_bytes: int, free_bytes: int,
                 wait_s: float) -> ServiceError:
        free_mib = free_bytes // MIB
        missing_mib = math.ceil((total_bytes - free_bytes) / MIB)
        parts = []
        if need_bytes > 0:
            parts.append(f"{math.ceil(need_bytes / MIB)} MiB to map")
        if self.min_free_vram_mib:
            parts.append(f"{self.min_free_vram_mib} MiB reserve")
        waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
        advice = " or lower --min-free-vram-mib" if self.min_free_vram_mib else ""
        return ServiceError("insufficient_vram",
            f"cannot {what} yet: needs {math.ceil(total_bytes / MIB)} MiB free "
            f"({' + '.join(parts)}), {free_mib} MiB free{waited}: {missing_mib} MiB missing; "
            f"waiting for VRAM: retry later, close other GPU apps{advice}",
            retry_after_s=RETRY_AFTER_S,
        )
