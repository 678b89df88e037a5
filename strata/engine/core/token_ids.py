"""Token ids from the host onto the device without waiting for the GPU.

`torch.tensor(ids, device="cuda")` copies from pageable memory and then synchronizes the
stream: a prompt's second prefill step waited there for all of its first step's kernels, so
the GPU sat idle while the host launched the next step's (docs/benchmarks.md, run 24). From
pinned memory the copy is queued like any kernel; torch's pinned-block cache keeps the block
until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def ids_on(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """token_ids as a long tensor [T] on device, queued behind the stream's work (no sync)."""
    if device.type != "cuda":
        return torch.tensor(list(token_ids), dtype=torch.long, device=device)
    host = torch.tensor(list(token_ids), dtype=torch.long, pin_memory=True)
    return host.to(device, non_blocking=True)
