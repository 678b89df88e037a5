"""cpu_expert_misses for one model's memory: the mode and the bound of its CPU forms, checked
as the memory is made, and the CpuMisses (fast/moe_cpu_misses.py) made once a partial expert
cache needs them, closed with the model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from strata.engine.core.engine_config import (
    DEFAULT_CPU_EXPERT_CACHE_BYTES,
    check_cpu_expert_misses,
)
from strata.units import MIB

if TYPE_CHECKING:
    from strata.engine.core.fast.moe_cpu_misses import CpuMisses
    from strata.engine.core.memory.expert_store import ExpertStore

log = logging.getLogger(__name__)


class CpuMissSetting:
    """A partial cache's one-token misses computed on the CPU ("on", "auto") or read in
    place ("off"); cache_bytes bounds their CPU forms (memory/cpu_expert_cache.py)."""

    def __init__(self, mode: str = "off", cache_bytes: int = DEFAULT_CPU_EXPERT_CACHE_BYTES):
        self.mode = check_cpu_expert_misses(mode)
        if cache_bytes < 0:
            raise ValueError(f"cpu_expert_cache_bytes must be >= 0, not {cache_bytes}")
        self.cache_bytes = cache_bytes
        self.cpu_misses: CpuMisses | None = None

    def for_store(self, store: ExpertStore | None, dtype: torch.dtype) -> CpuMisses | None:
        """The CPU-computed misses of store's partial cache where asked for and the GPU reads
        the host copy in place (the slot table's path; else decode takes the loop); made
        once."""
        if self.mode == "off" or store is None or store.host.device_address is None:
            return None
        if self.cpu_misses is None:
            from strata.engine.core.fast.moe_cpu_misses import CpuMisses

            self.cpu_misses = CpuMisses(store, self.mode, self.cache_bytes, dtype)
            store.cpu_misses = self.cpu_misses
            log.info("expert misses of one-token decode computed on the CPU (%s; their CPU "
                     "forms keep up to %.0f MiB)", self.mode, self.cache_bytes / MIB)
        return self.cpu_misses

    def close(self) -> None:
        """Stop the workers and drop the CPU forms (before the host copy they read goes)."""
        if self.cpu_misses is not None:
            self.cpu_misses.close()
            self.cpu_misses = None
