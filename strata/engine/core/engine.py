"""The synchronous engine core: load a model, generate tokens, reuse cached prefixes.

No threads and no I/O loop here (STYLE §6): the engine process (process.py) and the CLI wrap
it. Each cache slot keeps the token history whose K/V are in its cache, so a prompt that
extends the previous one only prefills the new tokens. Slots live in a SlotManager (slots.py):
resident while the KV budget allows, else snapshotted to RAM or disk and restored on return.
Every weight, expert and KV byte lives in a memory arena (residency.py, kv_arena.py) that the
lifecycle levels release and bring back at the same addresses.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pkgutil
import time
from collections.abc import Iterator, Sequence

import psutil
import torch

from strata.engine.core.constraint import TokenConstraint, build_constraint
from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.engine_errors import (
    EngineBusy,
    EngineError,
    EngineOutOfMemory,
    LevelNotApplicable,
    kv_mapping,
)
from strata.engine.core.kv_arena import ArenaSlotManager, KVArena
from strata.engine.core.loader import load_model_config
from strata.engine.core.loader.quant_plan import DEFAULT_MAX_CONTEXT_TOKENS, kv_bytes
from strata.engine.core.memory.backend import ArenaBackend, backend_for
from strata.engine.core.memory.budget import BudgetedBackend
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.quant.weight import (
    count_parameters,
    count_quantized,
    release_scratch,
    scratch_bytes,
)
from strata.engine.core.random_weights import (
    DEFAULT_STD,
    parameter_bytes,
    random_weights_config,
)
from strata.engine.core.residency import ASLEEP, ModelMemory
from strata.engine.core.sampling import Sampler
from strata.engine.core.snapshots import KVLayout, SlotCache, SnapshotStore, model_fingerprint
from strata.engine.core.snapshots.kv_state import dtype_name
from strata.engine.core.weight_source import FileWeights, RandomWeights, random_fingerprint
from strata.engine.protocol import (
    NUM_CACHE_SLOTS,
    SamplingSpec,
    TokenLogprob,
    Usage,
    slot_problem,
)

__all__ = ["Engine", "EngineBusy", "EngineConfig", "EngineError", "EngineOutOfMemory",
           "LevelNotApplicable", "common_prefix_length", "pick_device"]

log = logging.getLogger(__name__)

PREFILL_CHUNK_TOKENS = 512


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pick_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if requested == "cuda":
        raise EngineError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return torch.device("cpu")


def compute_dtype(device: torch.device, config: ModelConfig) -> torch.dtype:
    """bf16 on GPUs (half the bytes per token read). On the CPU float32 (exact parity, and
    faster for a small model's decode), unless float32 weights would take more than half the
    RAM: then bf16, which halves them and multiplies large matrices faster on CPUs with bf16
    instructions (bench/diag_cpu_dtype.py, docs/benchmarks.md)."""
    if device.type == "cuda":
        return torch.bfloat16
    ram_bytes = psutil.virtual_memory().total
    if parameter_bytes(config, torch.float32) > ram_bytes // 2:
        log.info("float32 weights would take over half of the %.0f GiB of RAM: bf16 instead",
                 ram_bytes / (1 << 30))
        return torch.bfloat16
    return torch.float32


def make_fast_decoder(model: torch.nn.Module, device: torch.device, step_hook=None):
    """The CUDA-graph decoder for a model on a GPU; None on the CPU or with STRATA_FAST=0.
    step_hook: a partial expert cache's promotion (ModelMemory.promotion), or None."""
    if device.type != "cuda" or os.environ.get("STRATA_FAST", "1") == "0":
        return None
    from strata.engine.core.fast.decode_graph import GraphDecoder

    def flag(name: str) -> bool | None:  # unset: the decoder decides; "0"/"1": off/on
        value = os.environ.get(name)
        return None if value is None else value == "1"

    decoder = GraphDecoder(
        model,
        use_cuda_graphs=flag("STRATA_FAST_GRAPHS"),
        compile_pointwise=flag("STRATA_FAST_COMPILE"),
        fused_attention=flag("STRATA_FAST_ATTENTION"),
        dense_kernels=flag("STRATA_FAST_DENSE"),
        step_hook=step_hook,
    )
    if decoder.note:
        log.info("fast decode: %s", decoder.note)
    tuned = decoder.tune_prefill(graphs=flag("STRATA_FAST_PREFILL_GRAPHS") is not False)
    if tuned["warm_up_s"]:
        log.info("prefill kernels compiled in %.1f s", tuned["warm_up_s"])
    if seconds := tuned["ops_s"]:
        log.info("prefill element-wise groups: %s (one chunk: compiled %.1f ms, eager %.1f ms)",
                 "compiled" if decoder.prefill_ops.is_compiled else "eager",
                 seconds["compiled"] * 1e3, seconds["eager"] * 1e3)
    if graphs := tuned["graphs"]:
        log.info("prefill graphs for fresh prompts of up to %d tokens (a chunk replayed in "
                 "%.1f ms; a called prefill's host time %.1f ms)", graphs["graph_tokens"],
                 graphs["chunk_replay_s"] * 1e3, graphs["host_s"] * 1e3)
    return decoder


class Engine:
    """Loads one model and generates from it, one request at a time."""

    def __init__(self, config: EngineConfig, backend: ArenaBackend | None = None):
        """backend: the arenas' memory (default: CUDA VMM on a GPU, mmap on the CPU); tests pass
        a CpuMmapBackend with a budget to act out a GPU that another process fills."""
        self.config = config
        self.model_config: ModelConfig | None = None
        self.model: torch.nn.Module | None = None
        self.fast = None  # GraphDecoder on CUDA (fast/decode_graph.py), None: eager torch
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.context_tokens = 0
        self.slots: ArenaSlotManager | None = None
        self.memory: ModelMemory | None = None
        self.kv_arena: KVArena | None = None
        self._backend = backend
        self.last_usage: Usage | None = None
        self.load_time_s = 0.0
        self._logprobs: list[TokenLogprob] = []  # of tokens yielded, until take_logprobs()

    # ---- loading ------------------------------------------------------------------------------

    @staticmethod
    def warm_imports(config: EngineConfig | None = None) -> list[str]:
        """For a standby process: import the modules a GPU load imports on its critical path
        (torch.compile's dynamo and inductor, the fast decoder, the kernels) without creating a
        CUDA context, so the next load pays only for the model. Nothing on the CPU."""
        if getattr(config, "device", "auto") == "cpu" or not torch.cuda.is_available():
            return []
        names = ["torch._dynamo", "torch._inductor.compile_fx"]
        for package in ("strata.engine.core.fast", "strata.engine.core.quant"):
            module = importlib.import_module(package)
            names += [info.name for info in pkgutil.iter_modules(module.__path__, package + ".")]
        for name in names:
            importlib.import_module(name)
        return names

    def load(self) -> dict:
        """Read the model into arenas, build it over them, size the context. Returns what was
        loaded."""
        started_s = time.perf_counter()
        self.close()
        self.device = pick_device(self.config.device)
        backend = self._backend or backend_for(self.device)
        if self.config.vram_budget_bytes:
            backend = BudgetedBackend(backend, self.config.vram_budget_bytes)
        self.device = backend.device  # cuda:N: views and new tensors agree on the index
        if self.config.random_weights:
            config = random_weights_config(self.config.random_weights)
            source = RandomWeights(self.device)
            fingerprint = random_fingerprint(config, source.seed, DEFAULT_STD)
        else:
            config = load_model_config(self.config.model_path)
            source = FileWeights.open(self.config.model_path, config)
            fingerprint = model_fingerprint(self.config.model_path, config)
        self.dtype = compute_dtype(self.device, config)
        self.memory = ModelMemory(backend, self.dtype)
        try:
            self.model = self.memory.build(config, source, self.config.expert_cache)
            self.fast = make_fast_decoder(self.model, self.device, self.memory.promotion)
            del source
            self.model_config = config
            self.context_tokens = self.config.context_tokens or min(
                config.max_position_embeddings, DEFAULT_MAX_CONTEXT_TOKENS
            )
            self.kv_arena = KVArena(config, self.context_tokens, self.dtype, backend,
                                    NUM_CACHE_SLOTS)
            self.memory.arenas.add(self.kv_arena.arena)
            self.slots = self._build_slots(config, fingerprint)
        except BaseException:
            self.close()
            raise
        # Any forward over released memory becomes a Python error, not a GPU fault.
        self.model.register_forward_pre_hook(lambda module, args: self.memory.check_resident())
        self.load_time_s = time.perf_counter() - started_s
        self._log_memory(config)
        return self.info()

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

    def info(self) -> dict:
        config = self._require_model()
        return {
            "model_type": config.model_type,
            "context_tokens": self.context_tokens,
            "device": self.device.type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "parameter_count": count_parameters(self.model),
            "load_time_s": round(self.load_time_s, 3),
            "expert_cache": self.memory.expert_mode,
        }

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
        return ArenaSlotManager(NUM_CACHE_SLOTS, self.config.kv_budget_bytes, self.kv_arena, store)

    def _require_slots(self) -> ArenaSlotManager:
        self._require_model()
        return self.slots

    def _check_slot(self, slot: int) -> None:
        problem = slot_problem(slot)
        if problem:
            raise EngineError(problem)

    # ---- generation ---------------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, state: SlotCache, token_ids: Sequence[int]) -> torch.Tensor:
        """Run tokens after the slot's cached ones; returns the logits of the last one."""
        logits = None
        for start in range(0, len(token_ids), PREFILL_CHUNK_TOKENS):
            chunk = token_ids[start : start + PREFILL_CHUNK_TOKENS]
            self._grow_kv(state, len(state.tokens) + len(chunk))
            ids = torch.tensor(chunk, dtype=torch.long, device=self.device)  # [T]
            logits = self.model(ids, len(state.tokens), state.kv, last_only=True)[-1]  # [V]
            state.tokens.extend(chunk)
        return logits

    def _grow_kv(self, state: SlotCache, num_tokens: int) -> None:
        """Map the slot's KV pages for num_tokens positions before anything writes them."""
        with kv_mapping(f"the KV cache could not grow to {num_tokens} tokens"):
            state.kv.ensure_tokens(num_tokens)

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingSpec, slot: int = 0
    ) -> Iterator[list[int]]:
        """Yield new token ids step by step; close the iterator to cancel.

        Stops at an end-of-sequence or stop token (which is yielded), at max_tokens, or at the
        end of the context. `last_usage` holds the usage once the iterator is finished. With
        sampling.num_logprobs, take_logprobs() returns the records of the tokens yielded so far.
        """
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
        self._check_slot(slot)
        self.memory.check_resident()  # the service brings released arenas back first
        stop_ids = set(config.eos_token_ids) | set(sampling.stop_token_ids)
        max_new = min(sampling.max_tokens, self.context_tokens - len(prompt))
        constraint = self._constraint(sampling, stop_ids)
        num_generated = num_cached = 0
        finish_reason = "cancelled"
        self._logprobs = []
        # Restores the slot's snapshot if it has one; a snapshot that fails verification leaves
        # an empty history, so the prefix below is 0 and the prompt is prefilled from scratch.
        state = self._checkout(slot)
        try:
            # Reuse the longest common prefix; always recompute at least the last prompt token,
            # since its logits are what the first sampled token comes from.
            num_cached = min(common_prefix_length(state.tokens, prompt), len(prompt) - 1)
            del state.tokens[num_cached:]
            steps = (self._fast_tokens if self.fast is not None else self._plain_tokens)(
                state, prompt[num_cached:], sampling, max_new, constraint
            )
            with contextlib.closing(steps):
                for token, record in steps:
                    num_generated += 1
                    if record is not None:
                        self._logprobs.append(record)
                    yield [token]
                    # A grammar that is complete and allows no end token ends the output too.
                    if token in stop_ids or (constraint is not None and constraint.is_stopped):
                        finish_reason = "stop"
                        break
                else:
                    finish_reason = "length"  # max_tokens, or the end of the context
        finally:
            self.slots.checkin(slot)
            self.last_usage = Usage(
                prompt_tokens=len(prompt),
                completion_tokens=num_generated,
                cached_tokens=num_cached,
                finish_reason=finish_reason,
            )

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprob records of the tokens yielded since the last call (num_logprobs)."""
        records, self._logprobs = self._logprobs, []
        return records

    def _constraint(self, sampling: SamplingSpec, stop_ids: set[int]) -> TokenConstraint | None:
        """The request's grammar matcher (core/constraint.py), or None when unconstrained."""
        if sampling.grammar is None:
            return None
        model_path = None if self.config.random_weights else self.config.model_path
        return build_constraint(sampling.grammar, model_path, self.model_config.vocab_size,
                                sorted(stop_ids), self.device)

    def _plain_tokens(
        self, state: SlotCache, new_ids: list[int], sampling: SamplingSpec, max_new: int,
        constraint: TokenConstraint | None = None,
    ) -> Iterator[tuple[int, TokenLogprob | None]]:
        """Prefill new_ids, then sample and feed back one token per step (eager torch)."""
        history = [*state.tokens, *new_ids]
        sampler = Sampler(sampling, self.device, self.model_config.vocab_size, history)
        logits = self._forward(state, new_ids)
        for step in range(max_new):
            if constraint is not None:
                logits = constraint.mask(logits)
            token = int(sampler(logits))
            if constraint is not None:
                constraint.consume(token)
            yield token, sampler.last_logprob
            if step + 1 < max_new:
                logits = self._forward(state, [token])

    def _fast_tokens(
        self, state: SlotCache, new_ids: list[int], sampling: SamplingSpec, max_new: int,
        constraint: TokenConstraint | None = None,
    ) -> Iterator[tuple[int, TokenLogprob | None]]:
        """The GPU path: fused prefill, then decode steps replayed from captured CUDA graphs.

        Token i+1 is already enqueued when token i is yielded; a token's K/V counts as valid
        (joins state.tokens) only once the step that fed it has run.
        """
        start = len(state.tokens)
        # Graphs write K/V without asking: map every page this request can reach up front.
        ids = torch.tensor(new_ids, dtype=torch.long, device=self.device)
        reach = self.fast.prefill_reach(state.kv, len(new_ids), start)
        self._grow_kv(state, max(start + len(new_ids) + max_new, reach))
        logits = self.fast.prefill(state.kv, ids, start)
        state.tokens.extend(new_ids)
        if constraint is not None:
            logits = constraint.mask(logits)
        token = self.fast.sample_first(logits, sampling, state.tokens)
        if constraint is not None:
            constraint.consume(token)
        yield token, self.fast.last_logprob
        if max_new <= 1:
            return
        if constraint is not None:
            from strata.engine.core.fast.constrained_decode import constrained_decode

            steps = constrained_decode(self.fast, state.kv, token, len(state.tokens),
                                       max_new - 1, sampling, constraint)
        else:
            steps = self.fast.decode(
                state.kv, token, len(state.tokens), max_new - 1, sampling, continue_request=True
            )
        for next_token in steps:
            state.tokens.append(token)
            token = next_token
            yield token, self.fast.last_logprob

    def _checkout(self, slot: int) -> SlotCache:
        # On failure the snapshot went back to the store: nothing is lost.
        with kv_mapping(f"slot {slot}'s KV could not be mapped"):
            return self.slots.checkout(slot)

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
            "experts": self.memory.status(),
        }

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
        (misses read from the host copy), more grows back; see ModelMemory.resize_experts."""
        self._require_model()
        result = self.memory.resize_experts(num_slots)
        self._empty_device_cache()
        return result

    def sleep(self) -> dict:
        """Offload the sessions (snapshots first), then release weights, experts and KV.

        A session that cannot be written keeps its memory and nothing else is released."""
        slots = self._require_slots()
        if self.memory.is_sleeping:
            return {"freed_bytes": 0}
        if slots.in_use:
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

    def slots_status(self) -> list[dict]:
        """Per slot: id, n_ctx, n_tokens, location (gpu|cpu resident, ram, disk, empty), bytes."""
        slots = self._require_slots()
        return [{**row, "n_ctx": self.context_tokens} for row in slots.status()]

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
        self._empty_device_cache()
        if self.device.type == "cuda":
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                torch.cuda.synchronize(self.device)
                clear_workspaces()
            torch.cuda.empty_cache()

    def _close_slots(self) -> None:
        if self.slots is not None:
            slots, self.slots = self.slots, None
            slots.close()

    def _drop_model(self) -> None:
        """Slots first (persistent snapshots are written there), then the model's references."""
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
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.offload_for_exit(keep=keep_sessions_as is not None)
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

