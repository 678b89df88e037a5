"""The one shape of Service.status(): what /v1/status, /health, /metrics, the tray and the
rules read. Test fakes of the service produce exactly this (tests/service/test_status_schema.py
runs the real service and each fake side by side against it), so no reader needs a fallback
for a key only a fake makes.
"""

from __future__ import annotations

from typing import Any, TypedDict


class ArenaBytes(TypedDict):
    """One arena's memory: what it holds now and what it gave back (to be refilled)."""

    resident_bytes: int
    released_bytes: int


class SlotStatus(TypedDict):
    """One cache slot as the engine reports it (Engine.slots_status)."""

    id: int
    n_tokens: int
    location: str  # gpu | cpu (resident), ram | disk (a snapshot), empty
    bytes: int
    is_processing: bool
    n_ctx: int
    is_running: bool  # a sequence of the batch decodes in it


class EngineProcessStatus(TypedDict):
    """The engine process as the supervisor sees it."""

    pid: int | None
    state: str  # supervisor state: unloaded | starting | loaded | failed
    standby_pid: int | None
    engine_state: str | None  # the engine's own last word: loaded | sleeping (EngineState)
    model_info: dict[str, Any] | None  # the engine's load info (model type, device, dtype, ...)


class Histogram(TypedDict):
    """Prometheus-style cumulative buckets (latency.Histogram.snapshot)."""

    le_s: list[float]  # bucket upper bounds in seconds
    counts: list[int]  # observations <= each bound
    sum_s: float
    count: int


class BatchStatus(TypedDict):
    """Generations at the admission gate (admission.py) and the slots they share."""

    running: int  # sent to the engine, up to parallel
    waiting: int  # queued on the host, up to max_queue
    parallel: int
    max_queue: int
    num_slots: int


class ServiceCounters(TypedDict):
    """Totals since start (ServiceMetrics.snapshot); the activity the dashboard shows."""

    requests_total: int
    rejected_total: int
    prompt_tokens_total: int
    completion_tokens_total: int
    cached_tokens_total: int
    evaluated_tokens_total: int  # prompt tokens the engine evaluated (not from a cache)
    prefill_seconds_total: float  # the engine's prompt evaluation time, all requests
    decode_seconds_total: float  # its decode time, from each first token to the last
    max_sequence_tokens: int  # the longest sequence served: prompt + completion
    tokens_per_second: float  # decode speed of the last finished request
    last_prompt_tokens: int
    last_completion_tokens: int
    finish_reasons: dict[str, int]
    errors: dict[str, int]
    level_changes: dict[str, int]
    level_failures: dict[str, int]
    # From arrival (queue wait included) to the first token, between tokens, to the end.
    ttft_s: Histogram
    inter_token_s: Histogram
    request_s: Histogram


class ServiceStatus(TypedDict):
    """Service.status(): every level's state, bytes, idle countdowns, slots, engine, counters."""

    state: str  # a levels.State
    levels: dict[str, str] | None
    vram: dict[str, ArenaBytes]  # {} while nothing is loaded
    memory_kind: str  # "VRAM" on a GPU, "RAM" where the engine runs on the CPU
    idle: dict[str, float | None]  # seconds until each idle timer fires; None when off
    idle_timeouts: dict[str, float | None]
    idle_fired: dict[str, float]  # timers that fired this idle period: seconds ago
    model: str
    model_path: str | None
    context_tokens: int
    queue_length: int  # generations waiting: batch["waiting"]
    batch: BatchStatus
    is_busy: bool
    active_request_id: str | None
    engine_pid: int | None
    engine: EngineProcessStatus
    slots: list[SlotStatus] | None
    experts: dict[str, Any] | None
    last_error: str | None
    # One line when the engine runs on a GPU without Triton (GGUF blocks expanded to bf16,
    # fast kernels off): the engine's word once loaded, the host's forecast before.
    kernel_notice: str | None
    # Set while a step back up is refused for want of VRAM: {"what", "reason"} (a state).
    waiting_for_vram: dict[str, str] | None
    last_hook: dict[str, Any] | None
    free_vram_bytes: int | None
    retry_in_s: float
    engine_starts: int
    engine_crashes: int
    counters: ServiceCounters


class ModelRow(TypedDict):
    """One model of the pool (ModelPool.models()): the library's facts, its state and bytes."""

    name: str  # what requests send as `model`
    aliases: list[str]
    path: str
    format: str  # gguf | hf
    size_bytes: int  # on disk
    quantization: str
    architecture: str
    parameter_count: int
    context_tokens: int  # the model's own; 0 unknown
    is_default: bool  # the model the server was started with (absent `model` means it)
    is_downloaded: bool
    state: str  # a levels.State, or "available": no engine was ever started for it
    is_resident: bool  # holds memory now (a sleeping model does not count)
    vram_bytes: int  # estimated bytes it holds now
    load_bytes: int  # estimated bytes it holds once loaded
    last_used_s: float | None  # seconds since its last request or load; None: never


class PoolStatus(ServiceStatus):
    """ModelPool.status(): the default model's ServiceStatus plus every model's row."""

    models: list[ModelRow]
    default_model: str
    vram_budget_bytes: int  # --vram-budget; 0: free VRAM decides
