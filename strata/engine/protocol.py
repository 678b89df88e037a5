"""The closed, typed vocabulary spoken over the pipe between the host and the engine process.

Commands go host -> engine, events go engine -> host. Everything is a frozen dataclass of plain
Python values so it pickles cheaply; JSON never crosses into the engine. A bump of
PROTOCOL_VERSION means host and engine from different builds refuse to talk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# 2: penalties, logit_bias, num_logprobs, Tokens.logprobs; 3: grammar, ResizeExperts;
# 4: batching (Generate.slot None = the engine picks, Done.slot, EngineConfig.num_slots/parallel)
PROTOCOL_VERSION = 4
# The default number of KV cache slots of a loaded model (--slots N changes it): slots are
# 0..num_slots-1, one number for host and engine (EngineConfig.num_slots).
NUM_CACHE_SLOTS = 4


def slot_problem(slot: Any, num_slots: int = NUM_CACHE_SLOTS) -> str | None:
    """Why `slot` is not a cache slot number (an int in 0..num_slots-1); None when it is."""
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots:
        return f"cache slot must be 0..{num_slots - 1}, not {slot!r}"
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
    pass


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


@dataclass(frozen=True)
class Envelope:
    """A command with the id its reply carries, so the host can match answers to asks."""

    command_id: int
    command: Command
    version: int = PROTOCOL_VERSION


Command = (
    Load | Unload | Generate | Cancel | ReleaseExperts | RefillExperts | ResizeExperts
    | OffloadSession | RestoreSession | Sleep | Wake | SaveSlot | RestoreSlot | EraseSlot
    | GetStatus
)


# ---- events (engine -> host) ----------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str  # stop | length | cancelled


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


@dataclass(frozen=True)
class Reply:
    """The answer to a control command (Load, Sleep, ...): what it did, in plain values."""

    command_id: int
    result: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Status:
    """Engine-side state: arenas, slots, model; sent on GetStatus and after level changes."""

    state: str  # standby (no model) | loading | loaded | sleeping | failed
    info: dict[str, Any] = field(default_factory=dict)
    command_id: int | None = None  # the GetStatus it answers; None when sent unasked


@dataclass(frozen=True)
class Ready:
    """First message of a started engine process: it is alive and speaks this version."""

    pid: int
    version: int = PROTOCOL_VERSION


Event = Tokens | Done | Error | Reply | Status | Ready

COMMAND_TYPES = Command.__args__
EVENT_TYPES = Event.__args__
