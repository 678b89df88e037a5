"""The batch scheduler: which sequences wait, which run, and what one step does.

Up to `num_parallel` sequences run, each in a slot of its own; the rest wait in FIFO order
(one whose explicit slot a running sequence holds waits for it, and lets later ones pass).
A step runs at most one prefill chunk (`chunk_tokens` prompt tokens, shared among the
sequences still prefilling, the shortest remainder first; once a prompt got its first token,
only prompts that finish within the rest of the chunk join the step), then one decode step for every
sequence that was decoding, so a long prompt delays the running streams by at most one chunk
per step, and a short prompt that arrives meanwhile is not queued behind it. A prompt that
has the engine to itself (nothing else runs or waits) takes `solo_chunk_tokens` a step
instead, when larger: it delays nobody, and fewer chunks are faster (every chunk reads every
weight, and a quantized prefill dequantizes each once per chunk); a request that arrives
meanwhile waits for at most that one chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from strata.engine.core.batch.events import SequenceEvent
from strata.engine.core.batch.runner import BatchRunner
from strata.engine.core.batch.sequence import Phase, Sequence
from strata.engine.core.batch.slot_choice import choose_slot, common_prefix_length
from strata.engine.core.slots import SlotManager
from strata.engine.core.snapshots.kv_state import SlotCache


class BatchScheduler:
    """Sequences from add() to their end; `step()` advances all of them by one step."""

    def __init__(self, runner: BatchRunner, slots: SlotManager,
                 checkout: Callable[[int], SlotCache], num_parallel: int, chunk_tokens: int,
                 solo_chunk_tokens: int = 0):
        """checkout(slot) makes a slot resident and marks it in use (SlotManager.checkout with
        the engine's out-of-memory wrapping)."""
        if (num_parallel < 1 or num_parallel > slots.num_slots or chunk_tokens < 1
                or solo_chunk_tokens < 0):
            raise ValueError(f"need 1 <= num_parallel <= {slots.num_slots}, chunk_tokens >= 1 "
                             f"and solo_chunk_tokens >= 0, not {num_parallel}, {chunk_tokens}, "
                             f"{solo_chunk_tokens}")
        self.runner = runner
        self.slots = slots
        self.checkout = checkout
        self.num_parallel = num_parallel
        self.chunk_tokens = chunk_tokens
        self.solo_chunk_tokens = solo_chunk_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        # The model's forward calls (a prefill chunk, a decode step) and the sequences in them
        # summed, for /metrics (llama-server's n_decode_total, n_busy_slots_per_decode).
        self.num_forwards = 0
        self.num_forward_sequences = 0

    # ---- the synchronous API ----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def has_request(self, request_id: str) -> bool:
        return any(s.request_id == request_id for s in (*self.running, *self.waiting))

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence; it starts at a step when a slot and a lane are free."""
        if self.has_request(seq.request_id):
            raise ValueError(f"request {seq.request_id!r} is already running or waiting")
        self.waiting.append(seq)

    def cancel(self, request_id: str) -> SequenceEvent | None:
        """End a waiting or running sequence now; its Done event, or None if it is unknown."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.phase = Phase.FINISHED
                return SequenceEvent(request_id, usage=seq.usage())
        for seq in self.running:
            if seq.request_id == request_id:
                seq.finish_reason = "cancelled"
                return self._finish(seq)
        return None

    def cancel_all(self) -> list[SequenceEvent]:
        """Cancel everything (the engine closes, or the loop gives up on a broken step)."""
        ids = [s.request_id for s in (*self.running, *self.waiting)]
        return [event for rid in ids if (event := self.cancel(rid)) is not None]

    def step(self) -> list[SequenceEvent]:
        """Admit what can start, prefill one chunk, decode one token for every decoding
        sequence. Returns an event per sequence that produced a token or ended."""
        events: list[SequenceEvent] = []
        self._admit(events)
        decoding = [s for s in self.running if s.phase is Phase.DECODE]
        self._prefill(events)
        if decoding:
            self._decode(decoding, events)
        return events

    @property
    def running_slots(self) -> set[int]:
        return {s.slot for s in self.running if s.slot is not None}

    # ---- admission --------------------------------------------------------------------------

    def _admit(self, events: list[SequenceEvent]) -> None:
        while len(self.running) < self.num_parallel:
            seq = next((s for s in self.waiting if s.requested_slot not in self.running_slots),
                       None)
            if seq is None:
                return  # the rest wait for slots that running sequences hold
            self.waiting.remove(seq)
            try:
                self._start(seq)
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                seq.phase = Phase.FINISHED
                events.append(SequenceEvent(seq.request_id, usage=seq.usage(), error=exc))
                continue
            self.running.append(seq)
            if seq.sampling.return_progress:  # before any prompt token runs: processed == cached
                events.append(SequenceEvent(seq.request_id,
                                            progress=seq.progress(is_start=True)))

    def _start(self, seq: Sequence) -> None:
        """Give the sequence its slot and reuse the longest common prefix of its cache."""
        slot = seq.requested_slot
        if slot is None:
            held = self.running_slots
            idle = [s for s in self.slots.idle_slots() if s.slot not in held]
            wanted = frozenset(s.requested_slot for s in self.waiting
                               if s.requested_slot is not None)
            slot = choose_slot(seq.prompt, idle, avoid=wanted)
        seq.started_s = time.monotonic()  # a restored snapshot counts as prompt evaluation
        cache = self.checkout(slot)  # restores a snapshot; fails with nothing held
        seq.slot, seq.cache = slot, cache
        # Always recompute at least the last prompt token: its logits give the first token.
        num_shared = common_prefix_length(cache.tokens, seq.prompt) if seq.sampling.reuse_cache \
            else 0
        seq.num_cached = min(num_shared, len(seq.prompt) - 1)
        del cache.tokens[seq.num_cached:]
        seq.phase = Phase.PREFILL

    # ---- prefill and decode -----------------------------------------------------------------

    def chunk_budget(self) -> int:
        """Prompt tokens this step may prefill: solo_chunk_tokens (if larger) while one
        sequence runs and none waits, else chunk_tokens."""
        if len(self.running) == 1 and not self.waiting:
            return max(self.chunk_tokens, self.solo_chunk_tokens)
        return self.chunk_tokens

    def _prefill(self, events: list[SequenceEvent]) -> None:
        budget = self.chunk_budget()
        # Shortest remainder first: a short prompt that arrives during a 32k prefill gets its
        # tokens in the next step instead of after the long one (its TTFT: one chunk + its own).
        prefilling = sorted((s for s in self.running if s.phase is Phase.PREFILL),
                            key=lambda s: len(s.prompt) - s.num_prefilled)
        gave_first_token = False
        for seq in prefilling:
            remaining = len(seq.prompt) - seq.num_prefilled
            if budget <= 0 or (gave_first_token and remaining > budget):
                # A first token made in this step is not held back for a partial chunk of a
                # longer prompt: the step ends and delivers it (TTFT: its own prefill only).
                return
            start = seq.num_prefilled
            chunk = seq.prompt[start : start + budget]
            budget -= len(chunk)
            try:
                logits = self.runner.prefill(seq, chunk)
                self.num_forwards += 1
                self.num_forward_sequences += 1
                if seq.sampling.return_progress:
                    events.append(SequenceEvent(seq.request_id, progress=seq.progress()))
                if seq.num_prefilled < len(seq.prompt):
                    continue
                if seq.max_new <= 0:
                    seq.finish_reason = "length"
                    events.append(self._finish(seq))
                    continue
                token, record = self.runner.sample_first(seq, logits, len(self.running) == 1)
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the others go on
                events.append(self._fail(seq, exc))
                continue
            seq.phase = Phase.DECODE
            gave_first_token = True
            events.append(self._emit(seq, token, record))

    def _decode(self, decoding: list[Sequence], events: list[SequenceEvent]) -> None:
        try:
            results = self.runner.decode(decoding)
        except Exception as exc:  # noqa: BLE001 - the shared forward failed: all of them fail
            events.extend(self._fail(seq, exc) for seq in decoding)
            return
        self.num_forwards += 1
        self.num_forward_sequences += len(decoding)
        for seq, result in zip(decoding, results, strict=True):
            if isinstance(result, Exception):
                events.append(self._fail(seq, result))
            else:
                events.append(self._emit(seq, *result))

    def _emit(self, seq: Sequence, token: int, record) -> SequenceEvent:
        is_done = seq.take_token(token)
        logprobs = (record,) if record is not None else ()
        if is_done:
            done = self._finish(seq)
            return SequenceEvent(seq.request_id, (token,), logprobs, done.usage, slot=seq.slot)
        return SequenceEvent(seq.request_id, (token,), logprobs, slot=seq.slot)

    # ---- the end of a sequence --------------------------------------------------------------

    def _leave(self, seq: Sequence) -> None:
        self.runner.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.slots.checkin(seq.slot)
        seq.phase = Phase.FINISHED

    def _finish(self, seq: Sequence) -> SequenceEvent:
        self._leave(seq)
        return SequenceEvent(seq.request_id, usage=seq.usage(), slot=seq.slot)

    def _fail(self, seq: Sequence, exc: Exception) -> SequenceEvent:
        self._leave(seq)
        return SequenceEvent(seq.request_id, usage=seq.usage(), error=exc, slot=seq.slot)
