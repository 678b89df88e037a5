"""The free-VRAM guard: before a load, wake or refill, wait until enough VRAM is free.

Another app (a game, ComfyUI) may still be letting go of its memory when the model comes back;
waiting a few seconds for it beats failing a map half-way. Past the wait the answer is a 503
with Retry-After, and nothing has changed: the level stays where it was.
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

    @property
    def is_enabled(self) -> bool:
        return self.min_free_vram_mib > 0

    async def _read(self) -> int | None:
        # NVML calls block for a moment (the first one initializes the library): off the loop.
        free_bytes = await asyncio.to_thread(self.reader)
        self.last_free_bytes = None if free_bytes is None else int(free_bytes)
        return self.last_free_bytes

    async def wait_for_room(self, what: str) -> int | None:
        """Return once the free VRAM reaches the minimum (the bytes free, or None unknown).

        `what` names the step for the message ("load the model", "wake"). Raises
        ServiceError(503, "insufficient_vram") with retry_after_s after `wait_s` seconds.
        """
        if not self.is_enabled:
            return None
        need_bytes = self.min_free_vram_mib * MIB
        deadline_s = time.monotonic() + self.wait_s
        has_logged = False
        while True:
            free_bytes = await self._read()
            if free_bytes is None or free_bytes >= need_bytes:
                return free_bytes
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise self._refusal(what, need_bytes, free_bytes)
            if not has_logged:
                log.info("waiting up to %.0f s for %d MiB of free VRAM before I %s (%d MiB free)",
                         self.wait_s, self.min_free_vram_mib, what, free_bytes // MIB)
                has_logged = True
            await asyncio.sleep(min(self.poll_interval_s, remaining_s))

    def _refusal(self, what: str, need_bytes: int, free_bytes: int) -> ServiceError:
        free_mib = free_bytes // MIB
        missing_mib = math.ceil((need_bytes - free_bytes) / MIB)
        return ServiceError(
            503, "insufficient_vram",
            f"cannot {what}: need {self.min_free_vram_mib} MiB free, {free_mib} MiB free after "
            f"waiting {self.wait_s:g} s: {missing_mib} MiB missing; close other GPU apps or "
            "lower --min-free-vram-mib",
            retry_after_s=RETRY_AFTER_S,
        )
