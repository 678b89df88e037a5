"""How many of a MoE layer's one-token misses the CPU computes while the GPU reads the others
in place, balanced per layer by which side finished last (CpuMisses.balance, issue 54).

A fixed share (CpuMisses.share) fits one machine: run 37's H100 host took ~90 us an expert
on 8 threads where the link read one in ~93 us, so half. A 3090's PCIe 4.0 link is half as
fast, a 6-core desktop's threads slower, and each moves the balance. The balance needs no
timings: when the CPU's sum lands, the GPU either still runs the layer's hits and in-place
reads (the link side was slower: give the CPU more) or has finished them (the CPU was:
give it less). Each layer's share moves one STEP per token toward where both finish at
once, and dithers there.
"""

from __future__ import annotations

import math

import torch

STEP = 0.05  # of a share a token: ~10 tokens to move one of 2-4 misses a layer
FLOOR = 0.05  # above 0, so a layer with a miss keeps one on the CPU: the probe needs one


class ShareBalance:
    """One MoE layer's CPU share of its misses, moved by `observe` after each token."""

    def __init__(self, share: float = 0.5):
        if not FLOOR <= share <= 1.0:  # NaN fails this too
            raise ValueError(f"a CPU share is in [{FLOOR}, 1], not {share}")
        self.share = share
        self.num_observed = 0

    def count(self, num_missed: int) -> int:
        """How many of num_missed misses go to the CPU: at least one where any missed."""
        return math.ceil(num_missed * self.share)

    def observe(self, gpu_busy: bool) -> None:
        """The GPU still ran this layer's part when the CPU's sum landed (raise the share),
        or had finished it (lower it)."""
        self.share = min(1.0, max(FLOOR, self.share + (STEP if gpu_busy else -STEP)))
        self.num_observed += 1


class GpuProbe:
    """Whether the GPU still runs what was queued on the current stream when `mark` was
    called. Off CUDA the device computed it in the caller's thread: never busy."""

    def __init__(self, device: torch.device):
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def mark(self) -> None:
        if self._event is not None:
            self._event.record()

    def busy(self) -> bool:
        return self._event is not None and not self._event.query()
