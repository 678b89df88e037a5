"""The engine's memory levels (DESIGN §4) and slot sessions (DESIGN §5), mixed into Engine.

Each method gives memory back or brings it back (the expert cache, the sessions' KV, the whole
model for sleep), or moves a slot's KV to or from a file; the engine process runs them between
batch steps (process.py: _LEVEL_METHODS). The arenas, slots and decoders are the Engine's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from strata.engine.core.engine_errors import (
    EngineBusy,
    EngineError,
    LevelNotApplicable,
    kv_mapping,
)
from strata.engine.core.engine_setup import fast_prefill_chunk_tokens, solo_chunk_tokens
from strata.engine.core.residency import ASLEEP

if TYPE_CHECKING:
    from strata.engine.core.engine_config import EngineConfig
    from strata.engine.core.kv_arena import ArenaSlotManager, KVArena
    from strata.engine.core.model_config import ModelConfig
    from strata.engine.core.residency import ModelMemory


class EngineLevels:
    """Engine's level and session commands; Engine (engine.py) provides the state below."""

    config: EngineConfig
    device: torch.device
    memory: ModelMemory | None
    kv_arena: KVArena | None
    fast: Any  # the graph decoder, or None (Engine.fast)
    _runner: Any  # the batch runner, or None before a load
    has_work: bool

    _require_model: Callable[[], ModelConfig]  # raises EngineError without a model
    _require_slots: Callable[[], ArenaSlotManager]
    _check_slot: Callable[[int], None]  # raises EngineError for a slot out of range

    # ---- memory levels (DESIGN §4) ------------------------------------------------------------

    def release_experts(self) -> dict:
        """Give the expert cache's memory back (MoE); not_applicable on a dense model or with
        the expert cache off. Returns freed_bytes once the memory is really free."""
        self._require_model()
        result = self.memory.release_experts()
        self._empty_device_cache()
        return result

    def refill_experts(self) -> dict:
        """Map the expert cache back and restore its residency; out_of_memory (state unchanged)
        when VRAM is short. With STRATA_VERIFY_REFILL=1 the result has differing_slots."""
        self._require_model()
        return self.memory.refill_experts()

    def resize_experts(self, num_slots: int) -> dict:
        """Serve from num_slots expert slots: fewer frees VRAM while the model keeps answering
        (misses read from the host copy), more grows back; see ModelMemory.resize_experts.
        Safe between the steps of running streams (the process loop runs it there). An
        all-resident model switches to the partial cache at its first shrink: its decoders
        drop the graphs over the resident experts and capture again at the next step."""
        self._require_model()
        memory = self.memory
        switches = memory.would_switch(num_slots)
        if switches and self.fast is not None:
            problem = self.fast.expert_cache_problem(
                memory.experts.host.device_address is not None)
            if problem:
                raise LevelNotApplicable(f"the experts cannot shrink while serving: {problem}; "
                                         "use release_experts")
        result = memory.resize_experts(num_slots)
        if result.get("switched_to_slots"):
            self._use_expert_cache()
        if self.has_work:  # between a stream's tokens: keep the prefill graphs (no recapture)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            self._empty_device_cache()
        return result

    def _use_expert_cache(self) -> None:
        """After a live switch to the partial cache (ModelMemory.switch_to_slots): the fast
        decoder and the batch decoder leave the graphs over the resident stacks behind and
        call the cache's promotion; the next step captures what it needs."""
        if self.device.type == "cuda":
            # The step queued before this command may still replay a graph being dropped
            # (and write into its pool): let it finish first, at most a step's time.
            torch.cuda.synchronize(self.device)
        if self.fast is not None:
            self.fast.use_expert_cache(self.memory.promotion)
        if self._runner is not None:
            self._runner.rebuild_batch_decoder()
        # A prompt alone now stages every layer's experts a chunk: the partial cache's solo
        # chunk, as a load into a partial cache sets it (engine_setup.solo_chunk_tokens).
        stages = self._stages_experts()
        if self.fast is not None:  # its prefill graphs are off since use_expert_cache
            self.fast.prefiller.chunk_tokens = fast_prefill_chunk_tokens(self.config, stages)
        self.scheduler.solo_chunk_tokens = solo_chunk_tokens(self.config, stages)

    def sleep(self) -> dict:
        """Offload the sessions (snapshots first), then release weights, experts and KV.

        A session that cannot be written keeps its memory and nothing else is released."""
        slots = self._require_slots()
        if self.memory.is_sleeping:
            return {"freed_bytes": 0}
        if slots.in_use or self.has_work:
            raise EngineBusy("a generation is running: sleep after it ends")
        resident_before = self._resident_bytes()
        offloaded = slots.offload_session()
        self.kv_arena.release_all()
        self.memory.release_for_sleep()
        self._free_caches_for_sleep()
        return {"freed_bytes": resident_before - self._resident_bytes(),
                "offloaded_slots": offloaded["offloaded_slots"]}

    def _resident_bytes(self) -> int:
        return sum(arena.resident_bytes for arena in self.memory.arenas)

    def wake(self) -> dict:
        """Map and copy back weights, then experts, at the same addresses; the sessions come
        back with their next request. out_of_memory (still asleep) when VRAM is short."""
        self._require_model()
        return self.memory.wake()

    def _check_awake(self) -> None:
        if self.memory is not None and self.memory.is_sleeping:
            raise EngineError(ASLEEP)

    # ---- slots and sessions (DESIGN §5) -------------------------------------------------------

    def offload_session(self) -> dict:
        """Snapshot the resident slots (RAM, then disk) and release their KV memory.

        A slot whose snapshot cannot be written keeps its memory; SnapshotWriteError says why.
        """
        result = self._require_slots().offload_session()
        self._empty_device_cache()
        return result

    def restore_session(self) -> dict:
        """Bring back the active slot of the last offload (the next request would do it too)."""
        self._check_awake()
        with kv_mapping("the session's KV could not be mapped"):
            return self._require_slots().restore_session()

    def save_slot(self, slot: int, filename: str) -> dict:
        """llama.cpp's /slots/{id}?action=save: the slot's KV to a file in the snapshot dir."""
        self._check_slot(slot)
        self._check_awake()
        with kv_mapping(f"slot {slot}'s KV could not be mapped"):
            return self._require_slots().save(slot, filename)

    def restore_slot(self, slot: int, filename: str) -> dict:
        """llama.cpp's /slots/{id}?action=restore: verify the file, then replace the slot."""
        self._check_slot(slot)
        self._check_awake()
        with kv_mapping(f"slot {slot}'s KV could not be mapped"):
            return self._require_slots().restore(slot, filename)

    def erase_slot(self, slot: int) -> dict:
        """llama.cpp's /slots/{id}?action=erase: forget the slot's history and its snapshot."""
        self._check_slot(slot)
        result = self._require_slots().erase(slot)
        self._empty_device_cache()
        return result

    def _empty_device_cache(self) -> None:
        # Released KV returns to torch's caching allocator on CUDA; hand it to the driver,
        # with the prefill graphs' activations (captured again on the next fresh prompt).
        if self.fast is not None:
            self.fast.drop_prefill_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _free_caches_for_sleep(self) -> None:
        """Asleep, the CUDA context alone should hold VRAM: drop the decode graphs and their
        pool (captured again by the first step after a wake), torch's cuBLAS workspaces and
        its cached blocks (issue 18: sleep held 1.2-1.5 GiB)."""
        if self.fast is not None:
            self.fast.clear()
        if self._runner is not None:
            self._runner.clear_graphs()  # the batch graphs' pool likewise
        self._empty_device_cache()
        if self.device.type == "cuda":
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                torch.cuda.synchronize(self.device)
                clear_workspaces()
            torch.cuda.empty_cache()
