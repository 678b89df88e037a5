"""The synchronous engine core: load a model, generate tokens, reuse cached prefixes.

No threads and no I/O loop here (STYLE §6): the engine process (process.py) and the CLI wrap
it. Requests share a continuous batch (batch/: add, step, cancel), each in a cache slot of its
own, one forward per step for every decoding sequence. Each cache slot keeps the token history
whose K/V are in its cache, so a prompt that extends the previous one only prefills the new
tokens. Slots live in a SlotManager (slots.py):
resident while the KV budget allows, else snapshotted to RAM or disk and restored on return.
Every weight, expert and KV byte lives in a memory arena (residency.py, kv_arena.py) that the
lifecycle levels release and bring back at the same addresses.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from functools import partial

import torch

from strata.engine.core import load_phases
from strata.engine.core.batch.events import SequenceEvent
from strata.engine.core.batch.runner import BatchRunner
from strata.engine.core.batch.scheduler import BatchScheduler
from strata.engine.core.batch.sequence import Sequence as BatchSequence
from strata.engine.core.batch.slot_choice import common_prefix_length
from strata.engine.core.constraint import TokenConstraint, build_constraint
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.engine_errors import (
    EngineBusy,
    EngineError,
    EngineOutOfMemory,
    LevelNotApplicable,
    kv_mapping,
)
from strata.engine.core.engine_levels import EngineLevels
from strata.engine.core.engine_setup import (
    compute_dtype,
    make_fast_decoder,
    max_prefill_tokens,
    pick_device,
    solo_chunk_tokens,
)
from strata.engine.core.engine_status import EngineReport
from strata.engine.core.kv_arena import ArenaSlotManager, KVArena
from strata.engine.core.load_phases import LoadPhases
from strata.engine.core.loader import load_model_config
from strata.engine.core.loader.quant_plan import DEFAULT_MAX_CONTEXT_TOKENS
from strata.engine.core.memory.backend import ArenaBackend, backend_for
from strata.engine.core.memory.budget import BudgetedBackend
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.quant.weight import blocks_notice, release_scratch
from strata.engine.core.random_weights import (
    DEFAULT_STD,
    random_weights_config,
)
from strata.engine.core.residency import ModelMemory
from strata.engine.core.snapshots import KVLayout, SlotCache, SnapshotStore, model_fingerprint
from strata.engine.core.snapshots.kv_state import dtype_name
from strata.engine.core.standby_imports import warm_imports
from strata.engine.core.weight_source import FileWeights, RandomWeights, random_fingerprint
from strata.engine.protocol import SamplingSpec, TokenLogprob, Usage, slot_problem

__all__ = ["Engine", "EngineBusy", "EngineConfig", "EngineError", "EngineOutOfMemory",
           "LevelNotApplicable", "common_prefix_length", "pick_device"]

log = logging.getLogger(__name__)


class Engine(EngineLevels, EngineReport):
    """Loads one model and generates from it: requests join a continuous batch (add, step,
    cancel; batch/scheduler.py), or run one at a time through generate(). Its memory levels
    and slot sessions are EngineLevels' (engine_levels.py), its status EngineReport's
    (engine_status.py)."""

    def __init__(self, config: EngineConfig, backend: ArenaBackend | None = None):
        """backend: the arenas' memory (default: CUDA VMM on a GPU, mmap on the CPU); tests pass
        a CpuMmapBackend with a budget to act out a GPU that another process fills."""
        self.config = config
        self.model_config: ModelConfig | None = None
        self.model: torch.nn.Module | None = None
        self.scheduler: BatchScheduler | None = None  # set by load
        self.num_embed_forwards = 0  # the model's forward calls for embeddings (EmbedJob)
        self._runner: BatchRunner | None = None
        self._fast = None
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.context_tokens = 0
        self.slots: ArenaSlotManager | None = None
        self.memory: ModelMemory | None = None
        self.kv_arena: KVArena | None = None
        self._backend = backend
        self.last_usage: Usage | None = None
        self.load_time_s = 0.0
        self.load_phases_s: dict[str, float] = {}  # seconds per phase of the last load
        self.tuning_source = "none"  # the prefill tuning: none | stored | measured
        self.kernel_notice: str | None = None  # why GGUF blocks were expanded (no Triton)
        self._logprobs: list[TokenLogprob] = []  # of tokens yielded, until take_logprobs()
        self._generate_ids = itertools.count()

    @property
    def fast(self):
        """The GraphDecoder on CUDA (fast/decode_graph.py); None: eager torch. Tests swap it
        in on the CPU (graphs off), so the batch runner follows whatever is set here."""
        return self._fast

    @fast.setter
    def fast(self, decoder) -> None:
        self._fast = decoder
        if self._runner is not None:
            self._runner.close_stream()
            self._runner.fast = decoder

    # ---- loading ------------------------------------------------------------------------------

    # The process finds the standby's warm-up on the engine class it was given.
    warm_imports = staticmethod(warm_imports)

    def load(self) -> dict:
        """Read the model into arenas, build it over them, size the context. Returns what was
        loaded, with the seconds of each phase (load_phases.py) in "load_phases_s"."""
        started_s = time.perf_counter()
        self.close()
        phases = LoadPhases()
        with load_phases.recording(phases):
            self._load(phases)
        if self.device.type == "cuda":
            # The warm-up, kernel checks and tuning leave their activations in torch's cache:
            # an idle engine beside a game or ComfyUI should hold what it maps and its graphs
            # only (the next long prompt takes what its chunk needs again, in a millisecond).
            torch.cuda.empty_cache()
        self.load_time_s = time.perf_counter() - started_s
        self.load_phases_s = {**phases.breakdown_s(),
                              "other_s": round(self.load_time_s - sum(phases.seconds.values()),
                                               3)}
        log.info("loaded in %.2f s (%s); prefill tuning %s", self.load_time_s,
                 phases.summary(), self.tuning_source)
        self._log_memory(self.model_config)
        return self.info()

    def _load(self, phases: LoadPhases) -> None:
        with phases.phase("cuda_init"):
            self.device = pick_device(self.config.device)
            backend = self._backend or backend_for(self.device)
            if self.config.vram_budget_bytes:
                backend = BudgetedBackend(backend, self.config.vram_budget_bytes)
            self.device = backend.device  # cuda:N: views and new tensors agree on the index
            phases.device = self.device  # a CUDA context not made yet is made at phase end
            self.kernel_notice = blocks_notice(self.device)
            if self.kernel_notice:
                log.warning("%s", self.kernel_notice)
        with phases.phase("read_file"):
            if self.config.random_weights:
                config = random_weights_config(self.config.random_weights)
                source = RandomWeights(self.device)
                fingerprint = random_fingerprint(config, source.seed, DEFAULT_STD)
            else:
                config = load_model_config(self.config.model_path)
                source = FileWeights.open(self.config.model_path, config)
                fingerprint = model_fingerprint(self.config.model_path, config)
        self.dtype = compute_dtype(self.device, config)
        self.memory = ModelMemory(backend, self.dtype, self.config.cpu_expert_misses,
                                  self.config.cpu_expert_cache_bytes)
        try:
            with phases.phase("map_weights"):  # residency marks build_model and warm_up
                self.model = self.memory.build(config, source, self.config.expert_cache,
                                               max_prefill_tokens(self.config))
            with phases.phase("decoder_setup"):  # tuning.py marks its own phases
                self.fast, self.tuning_source = make_fast_decoder(
                    self.model, self.device, self.config, self.memory.promotion,
                    stages_experts=self._stages_experts())
                self._defer_expert_cache_warm_up()
            del source
            with phases.phase("kv_and_slots"):
                self._build_kv_and_batch(config, backend, fingerprint)
        except BaseException:
            self.close()
            raise
        # Any forward over released memory becomes a Python error, not a GPU fault.
        self.model.register_forward_pre_hook(lambda module, args: self.memory.check_resident())

    def _defer_expert_cache_warm_up(self) -> None:
        """An all-resident MoE that a shrink may switch to the partial cache while serving
        compiles the slot-table kernels once idle (deferred work), so that switch does not
        wait for Triton's compiler between two tokens (GraphDecoder.warm_expert_cache)."""
        fast = self.fast
        if fast is None or not self.memory.can_switch_live or fast.expert_cache_problem(True):
            return
        fast.deferred.add([("compile the expert cache's kernels",
                            partial(fast.warm_expert_cache, self.memory.slot_experts))])

    def _build_kv_and_batch(self, config: ModelConfig, backend: ArenaBackend,
                            fingerprint: str) -> None:
        """The KV arena sized for the context, the slots over it, the batch scheduler."""
        self.model_config = config
        self.context_tokens = self.config.context_tokens or min(
            config.max_position_embeddings, DEFAULT_MAX_CONTEXT_TOKENS
        )
        if (config.sliding_window and not config.layer_types
                and self.context_tokens > config.sliding_window):
            # A window on every layer (Phi-3, Mistral), which attention does not apply: within
            # the window that is exact. Gemma 3's local layers apply theirs (layer_types).
            log.info("context capped at the model's sliding window of %d tokens (asked for %d)",
                     config.sliding_window, self.context_tokens)
            self.context_tokens = config.sliding_window
        self.kv_arena = KVArena(config, self.context_tokens, self.dtype, backend,
                                self.config.num_slots)
        self.memory.arenas.add(self.kv_arena.arena)
        self.slots = self._build_slots(config, fingerprint)
        self._runner = BatchRunner(self.model, self.fast, self.device, config.vocab_size,
                                   self._grow_kv, self.memory.check_resident)
        self.scheduler = BatchScheduler(self._runner, self.slots, self._checkout,
                                        self.config.num_parallel,
                                        self.config.prefill_chunk_tokens,
                                        solo_chunk_tokens(self.config, self._stages_experts()))

    def _stages_experts(self) -> bool:
        """Whether prefill chunks stage the experts from the host (a partial cache's staging
        area, memory/expert_staging.py): then a prompt alone takes the larger solo chunk."""
        store = self.memory.experts if self.memory is not None else None
        return store is not None and store.staging is not None

    def _require_model(self) -> ModelConfig:
        if self.model is None or self.model_config is None:
            raise EngineError("no model is loaded: load one first")
        return self.model_config

    def _build_slots(self, config: ModelConfig, fingerprint: str) -> ArenaSlotManager:
        """The slot manager over the kv arena and the configured snapshot store."""
        from strata import paths

        layout = KVLayout(
            config.num_hidden_layers, config.num_key_value_heads, config.head_dim,
            dtype_name(self.dtype),
        )
        store = SnapshotStore(
            self.config.snapshot_ram_budget_bytes,
            self.config.snapshot_dir or paths.snapshot_dir(),
            self.config.snapshot_disk_budget_bytes,
            persist=self.config.persist_sessions,
            ttl_s=self.config.snapshot_ttl_s,
            fingerprint=fingerprint,
            layout=layout,
            is_default_dir=not self.config.snapshot_dir,
        )
        return ArenaSlotManager(self.config.num_slots, self.config.kv_budget_bytes,
                                self.kv_arena, store)

    def _require_slots(self) -> ArenaSlotManager:
        self._require_model()
        return self.slots

    def _check_slot(self, slot: int) -> None:
        problem = slot_problem(slot, self.config.num_slots)
        if problem:
            raise EngineError(problem)

    # ---- generation: the batch API (STYLE §6) --------------------------------------------------

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec,
            slot: int | None = None) -> None:
        """Queue a request; `step()` runs it. slot None: the scheduler picks the slot whose
        cache shares the longest prefix with the prompt, else the least recently used idle
        one (batch/slot_choice.py). Raises EngineError for a request that cannot run."""
        config = self._require_model()
        prompt = list(prompt_ids)
        if not prompt:
            raise EngineError("the prompt is empty: send at least one token")
        if len(prompt) >= self.context_tokens:
            raise EngineError(
                f"the prompt is {len(prompt)} tokens, the context is {self.context_tokens}"
            )
        if max(prompt) >= config.vocab_size or min(prompt) < 0:
            raise EngineError(f"token ids must be in 0..{config.vocab_size - 1}")
        if slot is not None:
            self._check_slot(slot)
        if sampling.post_sampling_probs and self.fast is not None:
            # The graph decoder samples on the GPU and keeps no filtered distribution.
            raise EngineError("post_sampling_probs is not supported on the GPU's graph "
                              "sampler; leave it out (n_probs alone gives the logprobs)")
        if self.scheduler.has_request(request_id):
            raise EngineError(f"request {request_id!r} is already running or waiting")
        self.memory.check_resident()  # the service brings released arenas back first
        stop_ids = frozenset(config.eos_token_ids) | frozenset(sampling.stop_token_ids)
        self.scheduler.add(BatchSequence(
            request_id, prompt, sampling, slot, stop_ids,
            max_new=min(sampling.max_tokens, self.context_tokens - len(prompt)),
            constraint=self._constraint(sampling, stop_ids),
        ))

    def cancel(self, request_id: str) -> SequenceEvent | None:
        """End a waiting or running request now (its slot is free again); its final event
        (finish_reason cancelled), or None when no such request waits or runs."""
        return self.scheduler.cancel(request_id) if self.scheduler is not None else None

    def step(self) -> list[SequenceEvent]:
        """One batch step: admit waiting requests, prefill one chunk, decode one token for
        every decoding sequence. Returns the news of each request that has some."""
        return self.scheduler.step() if self.scheduler is not None else []

    def cancel_all(self) -> list[SequenceEvent]:
        """Cancel every waiting and running request; their final events."""
        return self.scheduler.cancel_all() if self.scheduler is not None else []

    @property
    def has_work(self) -> bool:
        """Whether any request runs or waits (step() has something to do)."""
        return self.scheduler is not None and self.scheduler.has_work

    @property
    def has_deferred_work(self) -> bool:
        """Whether there is work to run once idle (run_deferred_step): filling a grown
        expert cache's free slots (ModelMemory.fill_step), and what the load left:
        compiling the prefill groups, checking the decode kernels (fast/deferred_compile.py).
        False while a request runs or waits (decode's steps fill the slots then), and while
        asleep or with the experts released (a warm-up prefill reads them)."""
        if self.has_work or self.memory is None:
            return False
        try:
            self.memory.check_resident()
        except EngineError:
            return False
        return self.memory.has_fill_work or (self.fast is not None
                                             and self.fast.has_deferred_work)

    def run_deferred_work(self) -> list[str]:
        """Every step the load left, now (run_deferred_step until none is left), as the
        engine process runs them once idle: for callers without that loop (benchmarks,
        tests). The steps' names."""
        names = []
        while self.has_deferred_work:
            names.append(self.run_deferred_step())
        return names

    def run_deferred_step(self) -> str:
        """Run one short step of the deferred work (the caller checks has_deferred_work
        first); its name. Raises what the step raised: the work then ends, and the engine
        keeps serving as it did (eager prefill groups; slots filled by decode's misses)."""
        self.memory.check_resident()
        if self.memory.has_fill_work:  # first: a prefill soon after a grow reads the slots
            return self.memory.fill_step()
        return self.fast.run_deferred_step()

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingSpec, slot: int | None = 0
    ) -> Iterator[list[int]]:
        """One request on its own: yield new token ids step by step; close to cancel.

        Stops at an end-of-sequence or stop token (which is yielded), at max_tokens, or at the
        end of the context. `last_usage` holds the usage once the iterator is finished. With
        sampling.num_logprobs, take_logprobs() returns the records of the tokens yielded so far.
        For callers that run one request at a time (the CLI, tests, benchmarks); the engine
        process drives add / step / cancel instead.
        """
        self._require_model()
        if self.scheduler.has_work:
            raise EngineBusy("generate() runs one request alone; other requests are queued")
        request_id = f"generate-{next(self._generate_ids)}"
        self._logprobs = []
        self.add(request_id, prompt_ids, sampling, slot)
        is_finished = False
        try:
            while not is_finished:
                for event in self.step():
                    if event.error is not None:
                        self.last_usage, is_finished = event.usage, True
                        raise event.error
                    self._logprobs.extend(event.logprobs)
                    if event.usage is not None:
                        self.last_usage, is_finished = event.usage, True
                    if event.token_ids:
                        yield list(event.token_ids)
        finally:
            if not is_finished:
                event = self.cancel(request_id)
                if event is not None:
                    self.last_usage = event.usage

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprob records of the tokens yielded since the last call (num_logprobs)."""
        records, self._logprobs = self._logprobs, []
        return records

    def _constraint(self, sampling: SamplingSpec, stop_ids: frozenset[int]
                    ) -> TokenConstraint | None:
        """The request's grammar matcher (core/constraint.py), or None when unconstrained."""
        if sampling.grammar is None:
            return None
        model_path = None if self.config.random_weights else self.config.model_path
        return build_constraint(sampling.grammar, model_path, self.model_config.vocab_size,
                                sorted(stop_ids), self.device)

    def _grow_kv(self, state: SlotCache, num_tokens: int) -> None:
        """Map the slot's KV pages for num_tokens positions before anything writes them."""
        with kv_mapping(f"the KV cache could not grow to {num_tokens} tokens"):
            state.kv.ensure_tokens(num_tokens)

    def _checkout(self, slot: int) -> SlotCache:
        # On failure the snapshot went back to the store: nothing is lost.
        with kv_mapping(f"slot {slot}'s KV could not be mapped"):
            return self.slots.checkout(slot)

    # ---- closing ------------------------------------------------------------------------------

    def _close_slots(self) -> None:
        if self.slots is not None:
            slots, self.slots = self.slots, None
            slots.close()

    def _end_requests(self) -> None:
        """Every request ends (its slot checked in) and the decode stream closes."""
        if self.scheduler is not None:
            self.scheduler.cancel_all()
        self.scheduler = None
        if self._runner is not None:
            self._runner.close_stream()
        self._runner = None

    def _drop_model(self) -> None:
        """Requests end, then slots (persistent snapshots are written there), then the model's
        references."""
        self._end_requests()
        self._close_slots()
        self.model = self.fast = self.kv_arena = None

    def close_for_exit(self, keep_sessions_as: str | None = None) -> list[int]:
        """Unload's fast path, for a process that exits next: copy the sessions that must
        survive into RAM snapshots, give every arena's VRAM back and destroy the CUDA context
        so its memory goes too, and only then write those snapshots to disk, so the GPU is
        free while the disk writes (issue 18: a rule's unload gave VRAM back after 491 ms).

        keep_sessions_as: a file name with "{slot}" for every slot with a history (a rule's
        unload; the next load restores them). Returns the slots so kept. The host copies are
        left to the exit: unpinning them first made an 8B unload take 1.5 s."""
        self._end_requests()
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.release_all_kv(keep=keep_sessions_as is not None)
        self.model = self.fast = self.kv_arena = None
        if self.memory is not None:
            self.memory.arenas.close()
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            from strata.engine.core.memory.cuda_vmm import reset_primary_context

            torch.cuda.synchronize(self.device)
            reset_primary_context(self.device.index or 0)
        return slots.finish_for_exit(keep_sessions_as) if slots is not None else []

    def close(self) -> None:
        """Drop the model, caches and arenas; the caller's process may exit afterwards."""
        self._drop_model()
        if self.memory is not None:
            memory, self.memory = self.memory, None
            memory.close()
        release_scratch()  # the quantized prefill's dequantization buffer
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

