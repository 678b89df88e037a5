"""The closed, typed vocabulary spoken over the pipe between the host and the engine process.

Commands go host -> engine, events go engine -> host. Everything is a frozen dataclass of plain
Python values so it pickles cheaply; JSON never crosses into the engine. A bump of
PROTOCOL_VERSION means host and engine from different builds refuse to talk.
"""

from __future__ import annotations

import ntpath
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, get_args

# 2: penalties, logit_bias, num_logprobs, Tokens.logprobs; 3: grammar, ResizeExperts;
# 4: batching (Generate.slot None = the engine picks, Done.slot, EngineConfig.num_slots/parallel),
# a typed EngineStatus in Status and in every level Reply; 5: Embed is a request (request_id,
# answered in batches of Embeddings and a Done, ended early by Cancel), timings in Usage;
# 6: SamplingSpec.return_progress and the PromptProgress event, Embed pooling "none",
# SamplingSpec.post_sampling_probs
PROTOCOL_VERSION = 6
# The default number of KV cache slots of a loaded model (--slots N changes it): slots are
# 0..num_slots-1, one number for host and engine (EngineConfig.num_slots).
NUM_CACHE_SLOTS = 4


def slot_problem(slot: Any, num_slots: int = NUM_CACHE_SLOTS) -> str | None:
    """Why `slot` is not a cache slot number (an int in 0..num_slots-1); None when it is."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        return f"cache slot must be 0..{num_slots - 1}, not {slot!r}"
    return None


# Longest name a slot file may have (a file system's usual limit).
MAX_FILENAME_CHARS = 255


def filename_problem(filename: Any) -> str | None:
    """Why `filename` is not a plain file name inside the snapshot directory (a path part,
    traversal, a drive, NUL, empty or too long); None when it is. The one check, read by the
    HTTP edge, the service and the engine's snapshot store."""
    if not isinstance(filename, str) or not filename.strip():
        return "the slot file name is empty"
    if ("/" in filename or "\\" in filename or ".." in filename or "\0" in filename
            or ntpath.isabs(filename) or ntpath.splitdrive(filename)[0]
            or os.path.isabs(filename) or len(filename) > MAX_FILENAME_CHARS):
        return (f"slot file name {filename[:80]!r} is not a plain name (no '/', '\\', '..', "
                f"drive or NUL, at most {MAX_FILENAME_CHARS} characters)")
    return None


# ---- commands (host -> engine) --------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSpec:
    """Per-request generation parameters, validated on the host before they are sent."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # An llguidance grammar (JSON text) the output must match: the engine masks the logits
    # of every step with it (core/constraint.py). None: unconstrained.
    grammar: str | None = None
    # Penalties over the last penalty_last_n tokens of prompt and output (-1: all of them),
    # as llama.cpp applies them: repeat divides a seen token's positive logit (multiplies a
    # negative one); frequency subtracts per occurrence, presence once.
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    num_logprobs: int | None = None  # None: none; k: each token's logprob and the top k
    # With num_logprobs: the records hold the log of the probabilities the sampler drew from
    # (after bias, penalties, temperature, top-k, min-p, top-p; greedy: 1 for its pick), the
    # top ones those it kept (llama.cpp's post_sampling_probs), not the raw logits' logprobs.
    post_sampling_probs: bool = False
    # False: evaluate the whole prompt, reusing none of the slot's cached prefix (llama.cpp's
    # cache_prompt: false); the slot's cache still holds this prompt afterwards.
    reuse_cache: bool = True
    # True: the engine sends PromptProgress when the sequence gets its slot and after each
    # prefill chunk (llama.cpp's return_progress); off, a prompt costs no extra events.
    return_progress: bool = False

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0)


@dataclass(frozen=True)
class Load:
    model_path: str
    context_tokens: int = 0  # 0: the model's own context length (capped by the engine)
    device: str = "auto"  # auto | cpu | cuda
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Unload:
    # A file name with "{slot}": every slot's history is written there after the VRAM is
    # given back (a rule's unload keeps the conversation); the Reply lists "kept_slots".
    keep_sessions_as: str | None = None


@dataclass(frozen=True)
class Generate:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    # None: the engine picks the slot whose cached tokens share the longest prefix with the
    # prompt (above a threshold), else the least recently used idle slot (DESIGN §5).
    slot: int | None = 0


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class ReleaseExperts:
    pass


@dataclass(frozen=True)
class RefillExperts:
    pass


@dataclass(frozen=True)
class ResizeExperts:
    """Serve from num_slots expert slots (shrink_experts frees VRAM; more grows back)."""

    num_slots: int


@dataclass(frozen=True)
class OffloadSession:
    pass


@dataclass(frozen=True)
class RestoreSession:
    pass


@dataclass(frozen=True)
class Sleep:
    pass


@dataclass(frozen=True)
class Wake:
    pass


@dataclass(frozen=True)
class SaveSlot:
    slot: int
    filename: str


@dataclass(frozen=True)
class RestoreSlot:
    slot: int
    filename: str


@dataclass(frozen=True)
class EraseSlot:
    slot: int


@dataclass(frozen=True)
class GetStatus:
    pass


# How Embed pools a sequence's final hidden states (after the final norm) into one vector;
# "none": no pooling, a vector per token.
POOLINGS = ("last", "mean", "none")


@dataclass(frozen=True)
class Embed:
    """Embed each token sequence into one L2-normalized vector of hidden_size floats.

    A request like Generate: runs without reading or writing any cache slot, a few sequences
    per engine-loop step, so generations keep decoding beside it. Answered by Embeddings
    events with this request_id (the next vectors, in order) and a Done (usage.prompt_tokens:
    the tokens run; finish_reason "cancelled" after a Cancel). pooling: "last" (the last
    token's hidden state, the only one a causal model computes over the whole input),
    "mean" (of all tokens) or "none" (every token's hidden state, not normalized: the
    Embeddings carry a vector per token of each sequence, in order, as llama.cpp's pooling
    none answers).
    """

    request_id: str
    token_ids: tuple[tuple[int, ...], ...]
    pooling: str = "last"


@dataclass(frozen=True)
class Envelope:
    """A command with the id its reply carries, so the host can match answers to asks."""

    command_id: int
    command: Command
    version: int = PROTOCOL_VERSION


Command = (
    Load | Unload | Generate | Cancel | ReleaseExperts | RefillExperts | ResizeExperts
    | OffloadSession | RestoreSession | Sleep | Wake | SaveSlot | RestoreSlot | EraseSlot
    | GetStatus | Embed
)


# ---- events (engine -> host) ----------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str  # stop | length | cancelled
    # The engine's clock for this sequence: waiting for a slot, prompt evaluation until the
    # first token, decoding from the first token to the last (0 where it never got there).
    # Measurements, not counts: two usages of the same tokens compare equal whatever they took.
    queued_s: float = field(default=0.0, compare=False)
    prefill_s: float = field(default=0.0, compare=False)
    decode_s: float = field(default=0.0, compare=False)
    # Set by the host: bringing the model up (load, wake) for the request.
    load_s: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (log-softmax of the raw logits, as
    OpenAI reports it) and the top alternatives as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Tokens:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id when the request asked


@dataclass(frozen=True)
class PromptProgress:
    """How far a prompt's evaluation is (asked by SamplingSpec.return_progress): sent when
    the sequence gets its slot (processed == cached) and after each prefill chunk, the last
    with processed == total, before its first Tokens. prefill_s: the engine's clock since the
    sequence got its slot."""

    request_id: str
    total: int  # prompt tokens
    cached: int  # reused from the slot's cache
    processed: int  # in the cache now, the reused ones included
    prefill_s: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class Done:
    request_id: str
    usage: Usage
    slot: int | None = None  # the cache slot the sequence used; None if it never got one


@dataclass(frozen=True)
class Error:
    """A failure; request_id is None for failures of a control command or of the engine."""

    code: str  # e.g. out_of_memory, bad_request, busy, not_applicable, internal
    message: str
    request_id: str | None = None
    command_id: int | None = None


class EngineState(StrEnum):
    """What an engine process holds (str-valued: it reads and serializes as the word)."""

    STANDBY = "standby"  # a process without a model (torch imported, no CUDA context)
    LOADED = "loaded"
    SLEEPING = "sleeping"  # the model's memory released, host copies kept


@dataclass(frozen=True)
class ArenaStatus:
    """One memory arena as the engine reports it."""

    state: str  # mapped | partial | released
    reserved_bytes: int
    resident_bytes: int
    released_bytes: int


@dataclass(frozen=True)
class SlotStatus:
    """One KV cache slot (Engine.slots_status); /v1/status shows it as a dict of these keys."""

    id: int
    n_tokens: int
    location: str  # gpu | cpu (resident), ram | disk (a snapshot), empty
    bytes: int
    is_processing: bool
    n_ctx: int
    is_running: bool  # a sequence of the batch decodes in it (is_processing: the older name)


@dataclass(frozen=True)
class BatchCounts:
    """The engine's continuous batch: sequences running, waiting in its FIFO, and its width."""

    running: int
    waiting: int
    parallel: int


@dataclass(frozen=True)
class ForwardCounts:
    """The model's forward calls since its load (prefill chunks, decode steps, embedding
    chunks) and the sequences in them summed: a batched step is one call of many sequences."""

    steps: int
    sequences: int


_INT_FIELDS = ("reserved_bytes", "resident_bytes", "released_bytes", "id", "n_tokens", "bytes",
               "n_ctx", "running", "waiting", "parallel", "steps", "sequences")


def _typed_row(cls: type, row: Mapping[str, Any]) -> Any:
    """cls's fields read from an engine's plain row; a missing key or a wrong type raises
    TypeError (the engine and its test fake must report the same shape)."""
    values = {}
    for f in fields(cls):
        if f.name not in row:
            raise TypeError(f"{cls.__name__} row {dict(row)!r} lacks {f.name!r}")
        value = row[f.name]
        wanted = bool if f.name.startswith("is_") else int if f.name in _INT_FIELDS else str
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise TypeError(f"{cls.__name__}.{f.name} is {value!r}, not {wanted.__name__}")
        values[f.name] = value
    return cls(**values)


@dataclass(frozen=True)
class EngineStatus:
    """The engine's state, typed: every host reader (levels, VRAM, slots) reads this, never a
    dict. Sent in Status (GetStatus) and with every level Reply, so a level change needs no
    second round trip."""

    state: EngineState
    pid: int
    model: dict[str, Any] = field(default_factory=dict)  # Engine.info(): model_type, device, ...
    arenas: dict[str, ArenaStatus] = field(default_factory=dict)
    slots: tuple[SlotStatus, ...] = ()
    experts: dict[str, Any] | None = None  # the expert cache's counters; None without one
    standby: dict[str, bool] = field(default_factory=dict)  # a standby's import state
    num_slots: int = 0  # cache slots of the loaded model (--slots); 0 without a model
    batch: BatchCounts | None = None
    forwards: ForwardCounts | None = None  # None: an engine that does not count them

    @classmethod
    def of_engine(cls, report: Mapping[str, Any], pid: int) -> EngineStatus:
        """From Engine.status()'s plain dict (state, info keys, arenas, slots, experts)."""
        report = dict(report)
        state = EngineState(report.pop("state", EngineState.LOADED))
        arenas = {str(name): _typed_row(ArenaStatus, row)
                  for name, row in (report.pop("arenas", None) or {}).items()}
        slots = tuple(_typed_row(SlotStatus, row) for row in report.pop("slots", None) or ())
        experts = report.pop("experts", None)
        report.pop("arena_totals", None)  # the sum of arenas: derived, not carried
        num_slots = int(report.pop("num_slots", 0) or 0)
        batch_row = report.pop("batch", None)
        batch = _typed_row(BatchCounts, batch_row) if batch_row is not None else None
        forwards_row = report.pop("forwards", None)
        forwards = _typed_row(ForwardCounts, forwards_row) if forwards_row is not None else None
        return cls(state, pid, report, arenas, slots, experts, num_slots=num_slots, batch=batch,
                   forwards=forwards)

    @property
    def device(self) -> str | None:
        """cpu | cuda (the model's device), None without a model."""
        device = self.model.get("device")
        return str(device) if device is not None else None

    def resident_bytes(self) -> int:
        """Memory held over all arenas."""
        return sum(a.resident_bytes for a in self.arenas.values())


@dataclass(frozen=True)
class Reply:
    """The answer to a control command (Load, Sleep, ...): what it did, in plain values, and
    for the level commands (Load, ReleaseExperts, Sleep, ...) the engine's status after it."""

    command_id: int
    result: dict[str, Any] = field(default_factory=dict)
    engine: EngineStatus | None = None


@dataclass(frozen=True)
class Embeddings:
    """Part of the answer to Embed: the vectors of the next sequences, in order (pooling
    "none": a vector per token of each, whole sequences only), and the tokens they ran."""

    request_id: str
    vectors: tuple[tuple[float, ...], ...]
    num_tokens: int


@dataclass(frozen=True)
class Status:
    """The engine's status; sent on GetStatus."""

    engine: EngineStatus
    command_id: int | None = None  # the GetStatus it answers; None when sent unasked


@dataclass(frozen=True)
class Ready:
    """First message of a started engine process: it is alive and speaks this version."""

    pid: int
    version: int = PROTOCOL_VERSION


Event = Tokens | Done | Error | Reply | Status | Ready | Embeddings | PromptProgress

COMMAND_TYPES = get_args(Command)
EVENT_TYPES = get_args(Event)
