"""Work on a side stream, fenced on both sides: what torch.cuda.graph asks of a capture's
warm-up (and what a capture on a stream of one's own needs).

The side stream first waits for everything queued on the current stream, and the current
stream waits for the side stream's work when the block ends, even when it raised: the
decode, batch, prefill and expert graphs all warm up and capture this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def side_stream(device: torch.device | None = None,
                stream: torch.cuda.Stream | None = None) -> Iterator[torch.cuda.Stream]:
    """Run the block on `stream` (default: a new one on device) after the current stream's
    queued work; the current stream then waits for the block's. A tensor made in the block
    and read after it needs record_stream(current) if the side stream's pool may reuse it."""
    current = torch.cuda.current_stream(device)
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(current)
    try:
        with torch.cuda.stream(side):
            yield side
    finally:
        current.wait_stream(side)
