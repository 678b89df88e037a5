"""Latency histograms of generations (time to first token, between tokens, whole request),
kept as Prometheus-style cumulative buckets, and the clock one request carries.

Times run from the request's arrival, queue wait included: that is what a client waits.
"""

from __future__ import annotations

import bisect
import time

from strata.engine.service import status_schema as schema

# Bucket upper bounds in seconds (Prometheus `le`), from a fast GPU to a shared CPU.
TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INTER_TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
REQUEST_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    """Counts of observations per bucket, their sum and number."""

    def __init__(self, bounds_s: tuple[float, ...]):
        self.bounds_s = bounds_s
        self._counts = [0] * (len(bounds_s) + 1)  # the last: above every bound (+Inf only)
        self.sum_s = 0.0
        self.count = 0

    def observe(self, value_s: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self.bounds_s, value_s)] += times
        self.sum_s += value_s * times
        self.count += times

    def snapshot(self) -> schema.Histogram:
        """{"le_s": bounds, "counts": cumulative count per bound, "sum_s", "count"}."""
        cumulative, total = [], 0
        for count in self._counts[:-1]:
            total += count
            cumulative.append(total)
        return {"le_s": list(self.bounds_s), "counts": cumulative,
                "sum_s": round(self.sum_s, 6), "count": self.count}


class LatencyHistograms:
    """The three histograms of /metrics."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS_S)
        self.request = Histogram(REQUEST_BUCKETS_S)

    def snapshot(self) -> dict[str, schema.Histogram]:
        return {"ttft_s": self.ttft.snapshot(), "inter_token_s": self.inter_token.snapshot(),
                "request_s": self.request.snapshot()}


class RequestClock:
    """One generation's times: started at arrival, told of each batch of tokens."""

    def __init__(self, histograms: LatencyHistograms):
        self._histograms = histograms
        self.started_s = time.perf_counter()
        self.first_token_s: float | None = None
        self._last_token_s: float | None = None

    def tokens(self, num_tokens: int) -> None:
        """Tokens arrived; several at once (the host read late) share the gap evenly."""
        now_s = time.perf_counter()
        if self._last_token_s is None:
            self.first_token_s = now_s
            self._histograms.ttft.observe(now_s - self.started_s)
        elif num_tokens > 0:
            self._histograms.inter_token.observe((now_s - self._last_token_s) / num_tokens,
                                                 num_tokens)
        self._last_token_s = now_s

    def end(self) -> tuple[float, float]:
        """(seconds since arrival, seconds since the first token), recorded once it ended."""
        now_s = time.perf_counter()
        self._histograms.request.observe(now_s - self.started_s)
        decode_s = now_s - self.first_token_s if self.first_token_s is not None else 0.0
        return now_s - self.started_s, decode_s
