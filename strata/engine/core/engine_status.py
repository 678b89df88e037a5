"""The engine's status (for /v1/status) and its load report, mixed into Engine.

Reads only: what is loaded and how it loaded (info), the arenas, slots, batch, forward counts
and expert cache (status), and the log line of what the model holds on its device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from strata.engine.core.loader.quant_plan import kv_bytes
from strata.engine.core.quant.census import count_parameters, count_quantized
from strata.engine.core.quant.weight import scratch_bytes

if TYPE_CHECKING:
    from strata.engine.core.batch.scheduler import BatchScheduler
    from strata.engine.core.engine_config import EngineConfig
    from strata.engine.core.kv_arena import ArenaSlotManager
    from strata.engine.core.model_config import ModelConfig
    from strata.engine.core.residency import ModelMemory

log = logging.getLogger("strata.engine.core.engine")  # the engine's log lines, as before


class EngineReport:
    """Engine's status and load report; Engine (engine.py) provides the state below."""

    config: EngineConfig
    model: torch.nn.Module | None
    memory: ModelMemory | None
    scheduler: BatchScheduler | None
    fast: Any  # the graph decoder, or None (Engine.fast)
    device: torch.device
    dtype: torch.dtype
    context_tokens: int
    num_embed_forwards: int
    load_time_s: float
    load_phases_s: dict[str, float]
    tuning_source: str
    kernel_notice: str | None

    _require_model: Callable[[], ModelConfig]  # raises EngineError without a model
    _require_slots: Callable[[], ArenaSlotManager]

    def status(self) -> dict:
        """Engine-side state for /v1/status: arenas by name, slots, the expert cache."""
        if self.model is None:
            return {"state": "unloaded"}
        arena_status = self.memory.arenas.status()
        return {
            "state": "sleeping" if self.memory.is_sleeping else "loaded",
            **self.info(),
            "arenas": arena_status["arenas"],
            "arena_totals": arena_status["totals"],
            "slots": self.slots_status(),
            "num_slots": self.config.num_slots,
            "batch": self.batch_status(),
            "forwards": self.forward_counts(),
            "experts": self.memory.status(),
        }

    def forward_counts(self) -> dict:
        """{"steps", "sequences"}: the model's forward calls since the load (prefill chunks,
        decode steps, embedding chunks) and the sequences in them summed."""
        scheduler = self.scheduler
        steps = scheduler.num_forwards if scheduler else 0
        sequences = scheduler.num_forward_sequences if scheduler else 0
        return {"steps": steps + self.num_embed_forwards,
                "sequences": sequences + self.num_embed_forwards}

    def slots_status(self) -> list[dict]:
        """Per slot: id, n_ctx, n_tokens, location (gpu|cpu resident, ram, disk, empty), bytes."""
        slots = self._require_slots()
        return [{**row, "n_ctx": self.context_tokens} for row in slots.status()]

    def info(self) -> dict:
        """What is loaded and how: model type, context, device, dtype, load time and phases,
        the prefill tuning and compile state, the expert cache's mode."""
        config = self._require_model()
        return {
            "model_type": config.model_type,
            "context_tokens": self.context_tokens,
            "device": self.device.type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "parameter_count": count_parameters(self.model),
            "load_time_s": round(self.load_time_s, 3),
            "load_phases_s": dict(self.load_phases_s),
            "tuning": self.tuning_source,
            "kernel_notice": self.kernel_notice,  # None, or why blocks were expanded
            # When the prefill groups compile (none | at_load | deferred: after the load,
            # deferred_compile.py) and whether that is done; where the decode kernels'
            # verdicts came from (none | checked | stored).
            "compile": self.fast.compile if self.fast is not None else "none",
            "compile_state": self.fast.deferred.state if self.fast is not None else "none",
            "kernel_check": self.fast.kernel_check if self.fast is not None else "none",
            "expert_cache": self.memory.expert_mode,
        }

    def batch_status(self) -> dict:
        """{"running", "waiting", "parallel"}: the batch now, for /v1/status."""
        scheduler = self.scheduler
        return {"running": len(scheduler.running) if scheduler else 0,
                "waiting": len(scheduler.waiting) if scheduler else 0,
                "parallel": self.config.num_parallel}

    def _log_memory(self, config: ModelConfig) -> None:
        """One line: what the model holds on its device (the figure `strata info` estimates)."""
        weights = self.memory.weights.reserved_bytes
        experts = self.memory.experts.arena.reserved_bytes if self.memory.experts else 0
        kv = kv_bytes(config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
                      self.context_tokens) * self.dtype.itemsize // 2
        workspace = scratch_bytes()
        mib = 1 << 20
        log.info("model holds %.0f MiB on %s: weights %.0f MiB (%d tensors in GGML blocks), "
                 "experts %.0f MiB, KV %.0f MiB for one slot at %d tokens, workspace %.0f MiB",
                 (weights + experts + kv + workspace) / mib, self.device, weights / mib,
                 count_quantized(self.model), experts / mib, kv / mib, self.context_tokens,
                 workspace / mib)
