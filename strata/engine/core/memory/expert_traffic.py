"""A partial expert cache's host-to-device traffic, per MoE layer: the copies into slots
(timed where they run), what decode kernels read in place from the host copy (misses,
counted by ExpertPromotion), and the misses the CPU computed instead (fast/moe_cpu_misses.py).
ExpertStore holds one; its status carries these counters."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


class ExpertTraffic:
    """Counters of bytes moved and experts computed on the CPU, per layer and in total."""

    def __init__(self, num_layers: int):
        self.copied_bytes = [0] * num_layers
        self.host_read_bytes = [0] * num_layers
        self.num_cpu_experts = [0] * num_layers
        self._cpu_this_step = [0] * num_layers  # the step running now's (ExpertPromotion's)
        self.num_copy_calls = 0  # host-to-device copies issued (one per run and projection)
        # Copies into slots timed where they run (device events around each batch, read once
        # done): the rate misses move at, not bytes over decode time.
        self.timed_copy_bytes = 0
        self.copy_seconds = 0.0
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event, int]] = deque()

    @contextmanager
    def timed_copies(self, cuda: bool, nbytes: int) -> Iterator[None]:
        """Time the copies queued inside: device events on the current stream (read once
        done), or the wall clock for synchronous copies."""
        self.read_timings()  # the earlier batches' (keeps the list short)
        if cuda:
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        started_s = time.perf_counter()
        yield
        if cuda:
            copied = torch.cuda.Event(enable_timing=True)
            copied.record()
            self._timings.append((started, copied, nbytes))
        else:
            self.timed_copy_bytes += nbytes
            self.copy_seconds += time.perf_counter() - started_s

    def note_copy(self, layer: int, nbytes: int, num_calls: int) -> None:
        """nbytes of layer's experts copied into slots by num_calls copies."""
        self.copied_bytes[layer] += nbytes
        self.num_copy_calls += num_calls

    def count_host_reads(self, layers: Sequence[int], num_misses: Sequence[int],
                         bytes_per_expert: Sequence[int],
                         num_on_cpu: Sequence[int] | None = None) -> None:
        """Note a step's misses: decode kernels read them in place from the host copy, all
        but num_on_cpu of them, which the CPU computed (take_cpu_experts)."""
        on_cpu = num_on_cpu if num_on_cpu is not None else [0] * len(layers)
        for layer, misses, computed, nbytes in zip(layers, num_misses, on_cpu,
                                                   bytes_per_expert):
            self.host_read_bytes[layer] += max(0, misses - computed) * nbytes

    def note_cpu_experts(self, layer: int, count: int) -> None:
        """count of layer's misses in the running step were computed on the CPU, not read."""
        self.num_cpu_experts[layer] += count
        self._cpu_this_step[layer] += count

    def take_cpu_experts(self) -> list[int]:
        """Per layer, the misses computed on the CPU since the last call (a step's)."""
        taken, self._cpu_this_step = self._cpu_this_step, [0] * len(self._cpu_this_step)
        return taken

    def read_timings(self) -> None:
        """Add the copies whose end event has passed to the timed totals (never waits)."""
        while self._timings and self._timings[0][1].query():
            started, copied, nbytes = self._timings.popleft()
            self.timed_copy_bytes += nbytes
            self.copy_seconds += started.elapsed_time(copied) / 1e3

    def status(self) -> dict[str, Any]:
        """The totals, as plain values."""
        self.read_timings()
        return {"copied_bytes": sum(self.copied_bytes),
                "host_read_bytes": sum(self.host_read_bytes),
                "num_cpu_experts": sum(self.num_cpu_experts),
                "num_copy_calls": self.num_copy_calls,
                "timed_copy_bytes": self.timed_copy_bytes,
                "copy_seconds": self.copy_seconds,
                "copy_gb_s": (self.timed_copy_bytes / self.copy_seconds / 1e9
                              if self.copy_seconds > 0 else None)}

    def layer_status(self, layer: int) -> dict[str, int]:
        """One layer's counters, as plain values."""
        return {"copied_bytes": self.copied_bytes[layer],
                "host_read_bytes": self.host_read_bytes[layer],
                "num_cpu_experts": self.num_cpu_experts[layer]}
