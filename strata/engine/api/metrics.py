"""Prometheus text exposition (format 0.0.4) of service.status(), for GET /metrics: Strata's
own strata_* metrics, then llama.cpp's llamacpp:* names for what Strata measures alike."""

from __future__ import annotations

import math
from typing import Any

from strata.engine.service.levels import SERVICE_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
KNOWN_STATES = SERVICE_STATES

# (metric name, type, help, keys to look for in status()["counters"] or status() itself).
_METRICS = (
    ("strata_requests_total", "counter", "Generation requests served.",
     ("requests_total",)),
    ("strata_prompt_tokens_total", "counter", "Prompt tokens processed, cached ones included.",
     ("prompt_tokens_total",)),
    ("strata_completion_tokens_total", "counter", "Tokens generated.",
     ("completion_tokens_total",)),
    ("strata_cached_tokens_total", "counter", "Prompt tokens reused from a cache slot.",
     ("cached_tokens_total",)),
    ("strata_tokens_per_second", "gauge", "Decode speed of the last request.",
     ("tokens_per_second",)),
    ("strata_queue_length", "gauge", "Requests waiting for a place to generate.",
     ("queue_length",)),
)
# (metric name, help, key in status()["batch"])
_BATCH_GAUGES = (
    ("strata_requests_running", "Generations running in the engine's batch.", "running"),
    ("strata_requests_waiting", "Generations waiting in the host's queue.", "waiting"),
)
# (metric name, help, key in status()["counters"]): latency.LatencyHistograms' snapshots.
_HISTOGRAMS = (
    ("strata_time_to_first_token_seconds",
     "From a request's arrival (queue wait included) to its first token.", "ttft_s"),
    ("strata_inter_token_latency_seconds", "Between consecutive tokens of a stream.",
     "inter_token_s"),
    ("strata_request_duration_seconds", "From a request's arrival to its last event.",
     "request_s"),
)


# llama-server's metric names (its --metrics), for dashboards made for it: (name, type, help,
# key in status()["counters"] or "batch"); n_decode_total and n_busy_slots_per_decode come
# from the engine's forward counts (render_metrics' forwards).
_LLAMACPP_METRICS = (
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens", "evaluated_tokens_total"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache",
     "cached_tokens_total"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts",
     "prefill_seconds_total"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed",
     "completion_tokens_total"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens",
     "decode_seconds_total"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)",
     "max_sequence_tokens"),
    ("requests_processing", "gauge", "Number of requests processing", "running"),
    ("requests_deferred", "gauge", "Number of requests deferred", "waiting"),
)
# Strata has no speculative decoding: llama.cpp's counters of it stay 0.
_LLAMACPP_SPECULATIVE = (
    ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps"),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _lookup(status: dict[str, Any], keys: tuple[str, ...]) -> float:
    counters = status.get("counters")
    for source in (counters if isinstance(counters, dict) else {}, status):
        for key in keys:
            number = _number(source.get(key))
            if number is not None:
                return number
    return 0.0


def _format(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_metrics(status: dict[str, Any], rates: tuple[float, float] = (0.0, 0.0),
                   forwards: Any = None) -> str:
    """The status snapshot as Prometheus text; missing counters read as 0. rates: prompt and
    generation tokens per second since the last scrape (ServiceMetrics.take_rates);
    forwards: the engine's protocol.ForwardCounts (None: no engine runs, not reported)."""
    lines = []
    for name, kind, help_text, keys in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {_format(_lookup(status, keys))}"]
    state = str(status.get("state", "unloaded"))
    lines += ["# HELP strata_state The service's state: 1 for the current one.",
              "# TYPE strata_state gauge"]
    for known in dict.fromkeys((*KNOWN_STATES, state)):
        lines.append(f'strata_state{{state="{_escape_label(known)}"}} {int(known == state)}')
    batch_value = status.get("batch")
    batch = batch_value if isinstance(batch_value, dict) else {}
    for name, help_text, key in _BATCH_GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f"{name} {_format(_number(batch.get(key)) or 0.0)}"]
    counters_value = status.get("counters")
    counters = counters_value if isinstance(counters_value, dict) else {}
    for name, help_text, key in _HISTOGRAMS:
        lines += _histogram_lines(name, help_text, counters.get(key))
    lines += _arena_lines(status)
    lines += _model_lines(status.get("models"))
    lines += _llamacpp_lines(counters, batch, rates, forwards)
    return "\n".join(lines) + "\n"


def _llamacpp_lines(counters: dict[str, Any], batch: dict[str, Any],
                    rates: tuple[float, float], forwards: Any) -> list[str]:
    """llama-server's metrics under its names (llamacpp:...), from the same counters."""
    items = [(name, kind, help_text, _number({**counters, **batch}.get(key)) or 0.0)
             for name, kind, help_text, key in _LLAMACPP_METRICS]
    items += [(name, "counter", help_text, 0.0) for name, help_text in _LLAMACPP_SPECULATIVE]
    items += [("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s",
               rates[0]),
              ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
               rates[1])]
    if forwards is not None:  # since the model's load, as llama-server's since its start
        items += [("n_decode_total", "counter", "Total number of model forward calls (prefill "
                   "chunks, decode steps, embedding chunks)", float(forwards.steps)),
                  ("n_busy_slots_per_decode", "gauge", "Average number of sequences per "
                   "forward call", forwards.sequences / max(forwards.steps, 1))]
    lines = []
    for name, kind, help_text, value in items:
        lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                  f"llamacpp:{name} {_format(value)}"]
    return lines


def _model_lines(models: Any) -> list[str]:
    """A ModelPool's models (status()["models"]): the bytes each holds, 1 for each resident."""
    if not isinstance(models, list) or not models:
        return []
    lines = ["# HELP strata_model_memory_bytes Memory a model of the pool holds (estimated).",
             "# TYPE strata_model_memory_bytes gauge"]
    lines += [f'strata_model_memory_bytes{{model="{_escape_label(str(row["name"]))}",'
              f'state="{_escape_label(str(row["state"]))}"}} {_format(float(row["vram_bytes"]))}'
              for row in models]
    return lines


def _histogram_lines(name: str, help_text: str, histogram: Any) -> list[str]:
    """A Prometheus histogram: cumulative _bucket{le=...} lines, +Inf, _sum and _count."""
    if not isinstance(histogram, dict):
        return []
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for bound_s, count in zip(histogram["le_s"], histogram["counts"], strict=True):
        lines.append(f'{name}_bucket{{le="{_format(float(bound_s))}"}} {count}')
    lines += [f'{name}_bucket{{le="+Inf"}} {histogram["count"]}',
              f"{name}_sum {_format(float(histogram['sum_s']))}",
              f"{name}_count {histogram['count']}"]
    return lines


def _arena_lines(status: dict[str, Any]) -> list[str]:
    """strata_arena_{resident,released}_bytes{arena=...} from status()["vram"]."""
    vram = status.get("vram")
    if not isinstance(vram, dict) or not vram:
        return []
    lines = []
    for key, help_text in (("resident_bytes", "VRAM an arena holds now."),
                           ("released_bytes", "VRAM an arena gave back, to be refilled.")):
        name = f"strata_arena_{key}"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for arena, numbers in sorted(vram.items()):
            value = _number((numbers or {}).get(key)) or 0.0
            lines.append(f'{name}{{arena="{_escape_label(str(arena))}"}} {_format(value)}')
    return lines
