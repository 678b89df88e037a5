"""A torch-free engine with the real Engine's interface, for tests of the process and service.

Tokens are deterministic: the i-th new token is (sum(prompt) + i) % vocab_size, so a test can
compute the expected stream. Prompts containing CRASH_TOKEN or RAISE_TOKEN fail on demand after
the first new token: the process dies with exit code 1, or the engine raises.

The lifecycle levels work in miniature: arenas are byte counters that really change (weights,
experts on a MoE fake, kv growing with the tokens held), and like the real engine, generate
raises when it would touch a released arena (sleeping weights, released experts), so a test
passes only if the service brought them back first. An offloaded session is restored by
generate itself, as the real engine does. While `oom_file` exists, mapping memory (load, wake,
refill) fails with code out_of_memory and the missing bytes in the message.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from strata.engine.core.batch.events import SequenceEvent
from strata.engine.core.batch.slot_choice import IdleSlot, choose_slot
from strata.engine.protocol import SamplingSpec, TokenLogprob, Usage
from strata.errors import StrataError

CRASH_TOKEN = 999_999  # the engine process calls os._exit(1) after the first new token
RAISE_TOKEN = 999_998  # generate raises RuntimeError after the first new token
CRASH_EXIT_CODE = 1
MIB = 1 << 20
NUM_SLOTS = 4  # the default of EngineConfig.num_slots
NUM_EXPERT_SLOTS = 64  # the fake MoE's expert cache, like a partial one (slots mode)
NUM_EXPERTS = 8  # per layer: the fewest slots a resize keeps, as the engine's floor
MODULE_IMPORTED_AT_S = time.time()  # about when this engine process started importing


class FakeEngineError(StrataError):
    """A failure the fake reports like the real engine's EngineError."""


class FakeNotApplicable(FakeEngineError):
    code = "not_applicable"


class FakeOutOfMemory(FakeEngineError):
    code = "out_of_memory"


@dataclass(frozen=True)
class FakeEngineConfig:
    """EngineConfig's fields plus knobs that shape the fake's behaviour."""

    model_path: str = "fake-model"
    device: str = "cpu"
    context_tokens: int = 0  # 0: 4096
    vocab_size: int = 512
    token_delay_s: float = 0.0  # sleep before each new token, to make streams observable
    load_delay_s: float = 0.0
    crash_on_load: bool = False  # the process exits with code 3 inside load()
    fail_on_load: bool = False  # load() raises ValueError (a bad model file)
    eos_token_id: int | None = None
    weights_bytes: int = 64 * MIB
    expert_bytes: int = 0  # > 0: a MoE model whose expert cache holds this many bytes
    kv_bytes_per_token: int = 64 * 1024
    oom_file: str | None = None  # while this file exists, load, wake and refill fail out_of_memory
    snapshot_dir: str | None = None  # where save_slot writes; None: a temp dir per engine
    slot_delay_s: float = 0.0  # restore_slot sleeps this long first: a slot command that hangs
    num_slots: int = NUM_SLOTS  # as EngineConfig: --slots
    parallel: int = 0  # as EngineConfig: --parallel, 0 = one per slot

    @property
    def num_parallel(self) -> int:
        return self.parallel or self.num_slots


def expected_tokens(prompt_ids: Sequence[int], max_tokens: int, vocab_size: int = 512) -> list[int]:
    """The tokens FakeEngine generates for a prompt when no stop or EOS token interferes."""
    base = sum(prompt_ids)
    return [(base + i) % vocab_size for i in range(max_tokens)]


@dataclass(eq=False)
class _FakeSequence:
    """One request in the fake's batch: its token generator and where its usage lands."""

    request_id: str
    prompt: list[int]
    sampling: SamplingSpec
    requested_slot: int | None
    slot: int | None = None
    steps: Iterator[tuple[int, TokenLogprob | None]] | None = None
    result: dict = field(default_factory=dict)  # "usage", set when its generator ends


class FakeArena:
    """Byte accounting of one arena: what is mapped now and what was released."""

    def __init__(self, name: str, reserved_bytes: int):
        self.name = name
        self.reserved_bytes = reserved_bytes
        self.resident_bytes = 0
        self.released_bytes = 0

    @property
    def state(self) -> str:
        if self.resident_bytes == 0:
            return "released"
        return "mapped" if self.resident_bytes >= self.reserved_bytes else "partial"

    def set_resident(self, num_bytes: int) -> None:
        self.resident_bytes, self.released_bytes = num_bytes, 0

    def release(self) -> int:
        freed = self.resident_bytes
        self.released_bytes += freed
        self.resident_bytes = 0
        return freed

    def refill(self, oom_file: str | None) -> int:
        if oom_file and os.path.exists(oom_file):
            missing_mib = max(1, self.released_bytes // MIB)
            raise FakeOutOfMemory(
                f"cannot map {missing_mib} MiB for the {self.name} arena: {missing_mib} MiB "
                "missing; free VRAM and retry"
            )
        mapped = self.released_bytes
        self.resident_bytes += mapped
        self.released_bytes = 0
        return mapped

    def status(self) -> dict:
        return {"state": self.state, "reserved_bytes": self.reserved_bytes,
                "resident_bytes": self.resident_bytes, "released_bytes": self.released_bytes}


class FakeEngine:
    """Engine interface (load, generate, levels, slots, status, close) without a model."""

    def __init__(self, config: FakeEngineConfig):
        self.config = config
        self.constructed_at_s = time.time()
        self.is_loaded = False
        self.is_sleeping = False
        self.last_usage: Usage | None = None
        self._logprobs: list[TokenLogprob] = []
        self.slot_tokens: dict[int, list[int]] = {}  # resident KV, per slot
        self.in_use: set[int] = set()  # slots generating now
        self.offloaded: dict[int, list[int]] = {}  # snapshots in "host RAM"
        self.context_tokens = config.context_tokens or 4096
        self.arenas: dict[str, FakeArena] = {}
        self.expert_hits = self.expert_misses = 0
        self.expert_copied_bytes = 0  # into slots, by refills
        self.num_expert_slots = NUM_EXPERT_SLOTS
        self._snapshot_dir: Path | None = None
        self._is_temp_dir = False
        self.num_slots = getattr(config, "num_slots", NUM_SLOTS)
        self.num_parallel = getattr(config, "parallel", 0) or self.num_slots
        self.num_forwards = self.num_forward_sequences = 0  # what Engine.forward_counts says
        self._waiting: deque[_FakeSequence] = deque()
        self._running: list[_FakeSequence] = []
        self._last_used: dict[int, float] = {}

    @property
    def is_moe(self) -> bool:
        return self.config.expert_bytes > 0

    def load(self) -> dict:
        if self.config.crash_on_load:
            os._exit(3)
        if self.config.fail_on_load:
            raise ValueError(f"{self.config.model_path} is not a model file (fake failure)")
        time.sleep(self.config.load_delay_s)
        if self.config.oom_file and os.path.exists(self.config.oom_file):
            missing_mib = max(1, self.config.weights_bytes // MIB)
            raise FakeOutOfMemory(f"cannot map {missing_mib} MiB for the weights arena: "
                                  f"{missing_mib} MiB missing; free VRAM and retry")
        self.arenas = {"weights": FakeArena("weights", self.config.weights_bytes)}
        self.arenas["weights"].set_resident(self.config.weights_bytes)
        if self.is_moe:
            self.arenas["experts"] = FakeArena("experts", self.config.expert_bytes)
            self.arenas["experts"].set_resident(self.config.expert_bytes)
            self.num_expert_slots = NUM_EXPERT_SLOTS
        kv_reserved = self.config.num_slots * self.context_tokens * self.config.kv_bytes_per_token
        self.arenas["kv"] = FakeArena("kv", kv_reserved)
        self.is_loaded = True
        return self.info()

    def info(self) -> dict:
        return {
            "model_type": "fake-moe" if self.is_moe else "fake",
            "context_tokens": self.context_tokens,
            "device": "cpu",
            "dtype": "none",
            "parameter_count": 0,
            "constructed_at_s": self.constructed_at_s,
            "module_imported_at_s": MODULE_IMPORTED_AT_S,
        }

    # ---- generation ----------------------------------------------------------------------

    def _check_mapped(self) -> None:
        if self.is_sleeping:
            raise FakeEngineError("generate touched the released weights arena (sleeping)")
        if self.is_moe and self.arenas["experts"].resident_bytes == 0:
            raise FakeEngineError("generate touched the released experts arena")

    def _sync_kv(self) -> None:
        tokens = sum(len(t) for t in self.slot_tokens.values())
        self.arenas["kv"].set_resident(tokens * self.config.kv_bytes_per_token)

    def _logprob(self, token: int, num_top: int) -> TokenLogprob:
        # The fake's next token is certain (logprob 0); alternatives follow it, each less likely.
        top = tuple(((token + j) % self.config.vocab_size, -10.0 * j) for j in range(num_top))
        return TokenLogprob(token, 0.0, top)

    def take_logprobs(self) -> list[TokenLogprob]:
        """As Engine.take_logprobs: the records of the tokens yielded since the last call."""
        records, self._logprobs = self._logprobs, []
        return records

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingSpec, slot: int | None = 0
    ) -> Iterator[list[int]]:
        """One request alone, as Engine.generate."""
        self._check_request(prompt_ids, sampling)
        result: dict = {}
        self._logprobs = []
        steps = self._tokens(list(prompt_ids), sampling, slot, result)
        try:
            for token, record in steps:
                if record is not None:
                    self._logprobs.append(record)
                yield [token]
        finally:
            steps.close()
            self.last_usage = result.get("usage")

    def _check_request(self, prompt_ids: Sequence[int], sampling: SamplingSpec) -> None:
        if not self.is_loaded:
            raise RuntimeError("generate before load")
        if getattr(sampling, "grammar", None) is not None:
            # The real engine masks every step to the grammar; a fake that ignored it would
            # answer what the real one never can. Tests of grammars use the real engine.
            raise ValueError("the fake engine cannot constrain output to a grammar")
        self._check_mapped()
        if not list(prompt_ids):
            raise ValueError("the prompt is empty: send at least one token")

    def _tokens(self, prompt: list[int], sampling: SamplingSpec, slot: int, result: dict
                ) -> Iterator[tuple[int, TokenLogprob | None]]:
        """The request's (token, logprob record) steps; result["usage"] once it ends."""
        if slot in self.offloaded:  # the engine restores an offloaded session by itself
            self.slot_tokens[slot] = self.offloaded.pop(slot)
        history = self.slot_tokens.get(slot, [])
        started_s = time.monotonic()
        token_times_s: list[float] = []  # the real engine's timings, in Usage, from these
        num_cached = 0
        while num_cached < min(len(history), len(prompt) - 1) and history[num_cached] == prompt[num_cached]:
            num_cached += 1
        stop_ids = set(sampling.stop_token_ids)
        if self.config.eos_token_id is not None:
            stop_ids.add(self.config.eos_token_id)
        generated: list[int] = []
        finish_reason = "cancelled"
        self.in_use.add(slot)
        try:
            for token in expected_tokens(prompt, sampling.max_tokens, self.config.vocab_size):
                if generated and CRASH_TOKEN in prompt:
                    os._exit(CRASH_EXIT_CODE)
                if generated and RAISE_TOKEN in prompt:
                    raise RuntimeError("fake engine failure on request")
                time.sleep(self.config.token_delay_s)
                if self.is_moe:
                    self.expert_hits += 1
                generated.append(token)
                token_times_s.append(time.monotonic())
                record = None
                if sampling.num_logprobs is not None:
                    record = self._logprob(token, sampling.num_logprobs)
                yield token, record
                if token in stop_ids:
                    finish_reason = "stop"
                    break
            else:
                finish_reason = "length"
        finally:
            self.in_use.discard(slot)
            self.slot_tokens[slot] = prompt + generated
            self._last_used[slot] = time.monotonic()
            self._sync_kv()
            first_s, last_s = (token_times_s[0], token_times_s[-1]) if token_times_s else (
                time.monotonic(), time.monotonic())
            result["usage"] = Usage(len(prompt), len(generated), num_cached, finish_reason,
                                    prefill_s=first_s - started_s, decode_s=last_s - first_s)

    # ---- the batch API, as Engine's (core/batch): add, cancel, step ------------------------

    def add(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec,
            slot: int | None = None) -> None:
        self._check_request(prompt_ids, sampling)
        if slot is not None and not 0 <= slot < self.num_slots:
            raise FakeEngineError(f"cache slot must be 0..{self.num_slots - 1}, not {slot}")
        self._waiting.append(_FakeSequence(request_id, list(prompt_ids), sampling, slot))

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def batch_status(self) -> dict:
        return {"running": len(self._running), "waiting": len(self._waiting),
                "parallel": self.num_parallel}

    def cancel(self, request_id: str) -> SequenceEvent | None:
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                return SequenceEvent(request_id, usage=Usage(len(seq.prompt), 0, 0, "cancelled"))
        for seq in self._running:
            if seq.request_id == request_id:
                self._running.remove(seq)
                seq.steps.close()
                return SequenceEvent(request_id, usage=seq.result["usage"], slot=seq.slot)
        return None

    def cancel_all(self) -> list[SequenceEvent]:
        ids = [s.request_id for s in (*self._running, *self._waiting)]
        return [event for rid in ids if (event := self.cancel(rid)) is not None]

    def step(self) -> list[SequenceEvent]:
        """Admit what fits (slot chosen like the engine's), then one token per request."""
        held = {s.slot for s in self._running}
        while len(self._running) < self.num_parallel:
            seq = next((s for s in self._waiting if s.requested_slot not in held), None)
            if seq is None:
                break
            self._waiting.remove(seq)
            seq.slot = seq.requested_slot
            if seq.slot is None:
                idle = [IdleSlot(i, self.slot_tokens.get(i, self.offloaded.get(i, [])),
                                 len(self.slot_tokens.get(i, self.offloaded.get(i, []))),
                                 self._last_used.get(i, 0.0))
                        for i in range(self.num_slots) if i not in held]
                seq.slot = choose_slot(seq.prompt, idle)
            held.add(seq.slot)
            seq.steps = self._tokens(seq.prompt, seq.sampling, seq.slot, seq.result)
            self._running.append(seq)
        events = []
        if self._running:  # one "forward" per step, of every running sequence, as the engine
            self.num_forwards += 1
            self.num_forward_sequences += len(self._running)
        for seq in list(self._running):
            try:
                token, record = next(seq.steps)
            except StopIteration:
                self._running.remove(seq)
                events.append(SequenceEvent(seq.request_id, usage=seq.result["usage"],
                                            slot=seq.slot))
                continue
            except Exception as exc:  # noqa: BLE001 - as the engine: this request fails
                self._running.remove(seq)
                events.append(SequenceEvent(seq.request_id, usage=seq.result["usage"],
                                            error=exc, slot=seq.slot))
                continue
            events.append(SequenceEvent(seq.request_id, (token,),
                                        (record,) if record is not None else (), slot=seq.slot))
        return events

    # ---- levels --------------------------------------------------------------------------

    def _experts_arena(self) -> FakeArena:
        if not self.is_moe:
            raise FakeNotApplicable("a dense model has no expert cache to release or refill")
        return self.arenas["experts"]

    def release_experts(self) -> dict:
        return {"freed_bytes": self._experts_arena().release()}

    def refill_experts(self) -> dict:
        arena = self._experts_arena()
        if self.is_sleeping:
            raise FakeEngineError("cannot refill experts while the weights sleep; wake first")
        mapped = arena.refill(self.config.oom_file)  # what a shrink released comes back too
        self.num_expert_slots = NUM_EXPERT_SLOTS
        self.expert_copied_bytes += mapped
        return {"mapped_bytes": mapped}

    @property
    def _bytes_per_expert(self) -> int:
        return self.config.expert_bytes // NUM_EXPERT_SLOTS

    def resize_experts(self, num_slots: int) -> dict:
        """Like the engine's: keep at least one layer's experts; shrinking frees, growing maps
        (out_of_memory while oom_file exists)."""
        arena = self._experts_arena()
        if self.is_sleeping or arena.resident_bytes == 0:
            raise FakeEngineError("the expert cache is not resident: wake or refill it first")
        num_slots = max(min(num_slots, NUM_EXPERT_SLOTS), NUM_EXPERTS)
        delta_bytes = (num_slots - self.num_expert_slots) * self._bytes_per_expert
        if delta_bytes > 0 and self.config.oom_file and os.path.exists(self.config.oom_file):
            raise FakeOutOfMemory(f"growing the expert cache failed: {delta_bytes // MIB} MiB "
                                  "of VRAM missing for the experts arena; free VRAM and retry")
        arena.resident_bytes += delta_bytes
        arena.released_bytes = max(0, arena.released_bytes - delta_bytes)
        self.num_expert_slots = num_slots
        return {"num_slots": num_slots, "max_slots": NUM_EXPERT_SLOTS,
                "freed_bytes": max(0, -delta_bytes), "mapped_bytes": max(0, delta_bytes),
                "resident_bytes": arena.resident_bytes, "seconds": 0.0}

    def offload_session(self) -> dict:
        self._check_not_sleeping("offload the session")
        self.offloaded.update(self.slot_tokens)
        slots = sorted(self.slot_tokens)
        self.slot_tokens.clear()
        return {"offloaded_slots": slots, "freed_bytes": self.arenas["kv"].release()}

    def restore_session(self) -> dict:
        self._check_not_sleeping("restore the session")
        slots = sorted(self.offloaded)
        self.slot_tokens.update(self.offloaded)
        self.offloaded.clear()
        self._sync_kv()
        return {"restored_slots": slots}

    def sleep(self) -> dict:
        if self.is_sleeping:
            return {"freed_bytes": 0}
        self.offloaded.update(self.slot_tokens)
        self.slot_tokens.clear()
        freed = sum(arena.release() for arena in self.arenas.values())
        self.is_sleeping = True
        return {"freed_bytes": freed}

    def wake(self) -> dict:
        if not self.is_sleeping:
            return {"mapped_bytes": 0}
        # All or nothing, like the real arenas: check before mapping anything.
        mapped = self.arenas["weights"].refill(self.config.oom_file)
        if self.is_moe:
            mapped += self.arenas["experts"].refill(None)
        self.arenas["kv"].released_bytes = 0  # KV comes back per slot, on its next request
        self.is_sleeping = False
        return {"mapped_bytes": mapped}

    def _check_not_sleeping(self, what: str) -> None:
        if self.is_sleeping:
            raise FakeEngineError(f"cannot {what} while the model sleeps")

    # ---- slots ---------------------------------------------------------------------------

    def _slot_path(self, filename: str) -> Path:
        if self._snapshot_dir is None:
            self._is_temp_dir = self.config.snapshot_dir is None
            self._snapshot_dir = Path(self.config.snapshot_dir or tempfile.mkdtemp(prefix="fake-slots-"))
        return self._snapshot_dir / filename

    def save_slot(self, slot: int, filename: str) -> dict:
        tokens = self.slot_tokens.get(slot, self.offloaded.get(slot, []))
        data = json.dumps({"tokens": tokens}).encode()
        self._slot_path(filename).write_bytes(data)
        return {"id_slot": slot, "filename": filename, "n_saved": len(tokens), "n_written": len(data)}

    def restore_slot(self, slot: int, filename: str) -> dict:
        self._check_not_sleeping("restore a slot")
        time.sleep(self.config.slot_delay_s)
        tokens = json.loads(self._slot_path(filename).read_bytes())["tokens"]
        self.offloaded.pop(slot, None)
        self.slot_tokens[slot] = list(tokens)
        self._sync_kv()
        return {"id_slot": slot, "filename": filename, "n_restored": len(tokens)}

    def erase_slot(self, slot: int) -> dict:
        erased = len(self.slot_tokens.pop(slot, self.offloaded.pop(slot, [])))
        self._sync_kv()
        return {"id_slot": slot, "n_erased": erased}

    def slots_status(self) -> list[dict]:
        rows = []
        for slot in range(self.num_slots):
            if slot in self.slot_tokens:
                location, tokens = "cpu", self.slot_tokens[slot]  # resident, on its device
            elif slot in self.offloaded:
                location, tokens = "ram", self.offloaded[slot]
            else:
                location, tokens = "empty", []
            # The real engine's row (Engine.slots_status), checked by test_status_schema.py.
            rows.append({"id": slot, "n_tokens": len(tokens), "location": location,
                         "bytes": len(tokens) * self.config.kv_bytes_per_token,
                         "is_processing": slot in self.in_use, "is_running": slot in self.in_use,
                         "n_ctx": self.context_tokens})
        return rows

    # ---- status --------------------------------------------------------------------------

    def status(self) -> dict:
        if not self.is_loaded:
            return {"state": "unloaded"}
        experts = None
        if self.is_moe:
            lookups = self.expert_hits + self.expert_misses
            arena = self.arenas["experts"]
            # The real ExpertStore.status() keys, with the mode ModelMemory adds.
            experts = {"mode": "slots", "num_slots": self.num_expert_slots,
                       "max_slots": NUM_EXPERT_SLOTS, "bytes_per_expert": self._bytes_per_expert,
                       "total_experts": 2 * NUM_EXPERT_SLOTS,  # a partial cache's model
                       "num_resident": self.num_expert_slots if arena.resident_bytes else 0,
                       "num_hits": self.expert_hits, "num_misses": self.expert_misses,
                       "num_evictions": 0, "is_all_resident": False,
                       "hit_rate": self.expert_hits / lookups if lookups else None,
                       "is_released": arena.resident_bytes == 0, "state": arena.state,
                       "resident_bytes": arena.resident_bytes,
                       "copied_bytes": self.expert_copied_bytes,
                       "host_read_bytes": self.expert_misses * self._bytes_per_expert,
                       "num_cpu_experts": 0,  # cpu_expert_misses is off by default
                       # The real store's policy and copy counters (memory/expert_store.py);
                       # a refill's copy is not timed, so the rate is unknown (None).
                       "policy": "lfu", "num_left_out": 0, "num_copy_calls": 0,
                       # Every slot holds an expert: the fake never grows its cache.
                       "num_free_slots": 0, "num_filled": 0,
                       "timed_copy_bytes": 0, "copy_seconds": 0.0, "copy_gb_s": None,
                       # A CPU store's host copy: nothing placed (memory/numa.py).
                       "host_numa": {"requested_node": None, "policy": "default",
                                     "note": "not placed", "pages_by_node": {}},
                       # The prefill staging's figures (memory/expert_staging.py): the
                       # fake runs no prefill through it.
                       "staging_bytes": 0, "staged_experts": 0, "staged_bytes": 0,
                       "gathered_bytes": 0, "num_staged_copy_calls": 0,
                       # One MoE layer: every routed expert of the fake's is a hit.
                       "layers": [{"layer": 0, "num_hits": self.expert_hits,
                                   "num_misses": self.expert_misses, "num_left_out": 0,
                                   "copied_bytes": self.expert_copied_bytes,
                                   "host_read_bytes": self.expert_misses
                                   * self._bytes_per_expert, "num_cpu_experts": 0,
                                   "staged_bytes": 0}]}
        return {
            "state": "sleeping" if self.is_sleeping else "loaded",
            **self.info(),
            "arenas": {name: arena.status() for name, arena in self.arenas.items()},
            "slots": self.slots_status(),
            "num_slots": self.num_slots,
            "batch": self.batch_status(),
            "forwards": {"steps": self.num_forwards, "sequences": self.num_forward_sequences},
            "experts": experts,
        }

    def close_for_exit(self, keep_sessions_as: str | None = None) -> list[int]:
        """Engine.close_for_exit: every slot's history to keep_sessions_as (with "{slot}")."""
        kept = []
        if keep_sessions_as is not None:
            for slot in range(NUM_SLOTS):
                if self.slot_tokens.get(slot) or self.offloaded.get(slot):
                    self.save_slot(slot, keep_sessions_as.format(slot=slot))
                    kept.append(slot)
        self.close()
        return kept

    def close(self) -> None:
        self.is_loaded = False
        self.slot_tokens.clear()
        self.offloaded.clear()
        if self._is_temp_dir and self._snapshot_dir is not None:  # not persisted: gone on close
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)


FAKE_ENGINE_FACTORY = f"{__name__}:FakeEngine"
