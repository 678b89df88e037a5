"""Request counters of the service, as plain numbers for /v1/status.

The key names are the ones the API's /metrics renderer (engine/api/metrics.py) looks for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from strata.engine.protocol import Done, Error, Usage
from strata.engine.service.latency import LatencyHistograms, RequestClock
from strata.engine.service.status_schema import ServiceCounters


@dataclass
class ServiceMetrics:
    """Totals since the server started, plus the speed of the last finished request."""

    num_requests: int = 0  # requests that reached the engine
    num_rejected: int = 0  # requests refused before any event (engine down, bad request)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_tokens_per_s: float = 0.0
    last_prompt_tokens: int = 0
    last_completion_tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)  # stop | length | cancelled
    error_codes: Counter = field(default_factory=Counter)  # engine_crashed, internal, ...
    level_changes: Counter = field(default_factory=Counter)  # sleep, wake, ... that changed
    level_failures: Counter = field(default_factory=Counter)  # ... that failed
    latency: LatencyHistograms = field(default_factory=LatencyHistograms)
    # llama.cpp's /metrics counters: prompt tokens evaluated (cached ones not), the engine's
    # prompt and decode time, the longest sequence (prompt + completion).
    evaluated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    max_sequence_tokens: int = 0
    # The same since the last take_rates() (a /metrics scrape): its throughput gauges.
    window: list[float] = field(default_factory=lambda: [0, 0.0, 0, 0.0])

    def start_request(self) -> RequestClock:
        """A clock for a request that just arrived (its queue wait counts)."""
        return RequestClock(self.latency)

    def record_level(self, action: str, is_ok: bool) -> None:
        """Count a level change (by the API, the tray, a rule or an idle timer)."""
        (self.level_changes if is_ok else self.level_failures)[action] += 1

    def record(self, final: Done | Error | None, clock: RequestClock) -> None:
        """Count a request that reached the engine, by its last event; its clock ends here."""
        total_s, decode_s = clock.end()
        self.num_requests += 1
        if isinstance(final, Done):
            usage = final.usage
            self.prompt_tokens += usage.prompt_tokens
            self.completion_tokens += usage.completion_tokens
            self.cached_tokens += usage.cached_tokens
            self.finish_reasons[usage.finish_reason] += 1
            evaluated = max(usage.prompt_tokens - usage.cached_tokens, 0)
            decode_steps = max(usage.completion_tokens - 1, 0)  # the first came with the prompt
            self.evaluated_tokens += evaluated
            self.prefill_s += usage.prefill_s
            self.decode_s += usage.decode_s
            self.max_sequence_tokens = max(self.max_sequence_tokens,
                                           usage.prompt_tokens + usage.completion_tokens)
            for i, value in enumerate((evaluated, usage.prefill_s, decode_steps,
                                       usage.decode_s)):
                self.window[i] += value
            self.last_prompt_tokens = usage.prompt_tokens
            self.last_completion_tokens = usage.completion_tokens
            # Decode speed: tokens after the first over the time since it (prefill excluded).
            n = usage.completion_tokens
            if n > 1 and decode_s > 0:
                self.last_tokens_per_s = (n - 1) / decode_s
            else:
                self.last_tokens_per_s = n / total_s if total_s > 0 else 0.0
        elif isinstance(final, Error):
            self.error_codes[final.code] += 1
        else:
            self.error_codes["no_answer"] += 1

    def record_embedding(self, usage: Usage) -> None:
        """Count an embedding's prompt tokens as evaluated, as llama-server counts them."""
        self.evaluated_tokens += usage.prompt_tokens
        self.prefill_s += usage.prefill_s
        self.window[0] += usage.prompt_tokens
        self.window[1] += usage.prefill_s

    def take_rates(self) -> tuple[float, float]:
        """(prompt, generation) tokens per second since the last call, and a new window:
        llama.cpp's throughput gauges, averaged between two /metrics scrapes."""
        prompt_n, prompt_s, decode_n, decode_s = self.window
        self.window = [0, 0.0, 0, 0.0]
        return (prompt_n / prompt_s if prompt_s > 0 else 0.0,
                decode_n / decode_s if decode_s > 0 else 0.0)

    def snapshot(self) -> ServiceCounters:
        """The counters as a JSON-ready dict."""
        latency = self.latency.snapshot()
        return {
            "requests_total": self.num_requests,
            "rejected_total": self.num_rejected,
            "prompt_tokens_total": self.prompt_tokens,
            "completion_tokens_total": self.completion_tokens,
            "cached_tokens_total": self.cached_tokens,
            "evaluated_tokens_total": self.evaluated_tokens,
            "prefill_seconds_total": round(self.prefill_s, 6),
            "decode_seconds_total": round(self.decode_s, 6),
            "max_sequence_tokens": self.max_sequence_tokens,
            "tokens_per_second": round(self.last_tokens_per_s, 3),
            "last_prompt_tokens": self.last_prompt_tokens,
            "last_completion_tokens": self.last_completion_tokens,
            "finish_reasons": dict(self.finish_reasons),
            "errors": dict(self.error_codes),
            "level_changes": dict(self.level_changes),
            "level_failures": dict(self.level_failures),
            "ttft_s": latency["ttft_s"],
            "inter_token_s": latency["inter_token_s"],
            "request_s": latency["request_s"],
        }
