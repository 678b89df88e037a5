"""A fresh prompt's prefill replayed from a CUDA graph: short prefills are the host's time.

Called from Python, a prefill chunk costs the host about the same whatever its length, and
for a short prompt far more than its GPU work; replayed from a graph, the GPU work is all the
prefill costs (bench/diag_prefill_ops.py --replay; figures: docs/benchmarks.md, "Figures
behind the fast path"). So a prompt that starts
a slot (position 0) and fits one chunk is padded to a power-of-two bucket and replayed from
that bucket's graph. The rows past the prompt write K/V that decoding overwrites before reading,
and causal attention keeps them out of the prompt's rows; the logits come from the prompt's
last row, named by a device tensor (prefill's last_index).

Padding costs GPU work, so buckets stop where a replay would outlast the host's share of a
called prefill (`graph_tokens`, measured at load by tuning.plan_prefill_graphs): all of a
chunk for a small model, less for a larger one. A prompt after cached tokens or longer than
that, and an MoE prefill with experts not all resident (the expert loop asks the host which
experts run), run as called. A bucket's graph is captured on its first prompt, right after that
prompt ran as called (its logits are the answer, and the run has warmed every kernel up).
Graphs are keyed by the KV buffers' addresses, which the arenas keep fixed, and share one memory
pool; `clear` gives the pool back (the engine does on sleep and the other releases).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from strata.engine.core.fast.side_stream import side_stream
from strata.engine.core.kv_cache import KVCache

log = logging.getLogger(__name__)

MIN_BUCKET_TOKENS = 16

# (kv, ids [bucket], last_index [1]) -> logits [V] float32: fast/prefill.py's prefill bound to
# a model and its ops.
PaddedPrefill = Callable[[KVCache, torch.Tensor, torch.Tensor], torch.Tensor]


def bucket_sizes(max_tokens: int) -> list[int]:
    """Powers of two from MIN_BUCKET_TOKENS below max_tokens, then max_tokens itself."""
    sizes = []
    size = MIN_BUCKET_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


def prompt_bucket(num_tokens: int, max_tokens: int) -> int:
    """The length a prompt of num_tokens (<= max_tokens) is padded to."""
    return next(size for size in bucket_sizes(max_tokens) if size >= num_tokens)


def graph_tokens(host_s: float, chunk_replay_s: float, chunk_tokens: int) -> int:
    """The largest bucket worth a graph: its replay, the chunk's scaled by length, no longer
    than host_s (a called prefill's host time, which no prompt length goes below); 0 if none."""
    per_token_s = chunk_replay_s / chunk_tokens
    fits = [size for size in bucket_sizes(chunk_tokens) if size * per_token_s <= host_s]
    return fits[-1] if fits else 0


class PrefillGraphs:
    """One graph per (KV cache, bucket) for prompts of up to max_tokens at position 0."""

    def __init__(self, run: PaddedPrefill, device: torch.device, max_tokens: int):
        self._run = run
        self.device = device
        self.max_tokens = max_tokens  # 0: off
        self._last_index = torch.zeros(1, dtype=torch.long, device=device)
        # (KV addresses, bucket) -> (graph, its token ids [bucket], its logits [V])
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = None

    def bucket(self, num_tokens: int, kv: KVCache) -> int | None:
        """The padded length of a prompt of num_tokens at position 0, or None: run it called."""
        if not 0 < num_tokens <= self.max_tokens:
            return None
        size = prompt_bucket(num_tokens, self.max_tokens)
        return size if size <= kv.max_tokens else None

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, kv: KVCache, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [V] of token_ids [T] prefilled at position 0; `bucket` must have given one.
        K/V are written up to the bucket's length: the caller maps that much."""
        num_tokens = token_ids.shape[0]
        size = self.bucket(num_tokens, kv)
        if size is None:
            raise ValueError(f"no prefill graph takes {num_tokens} tokens into a KV cache of "
                             f"{kv.max_tokens}")
        key = (tuple(t.data_ptr() for t in (*kv.k, *kv.v)), size)
        entry = self._graphs.get(key)
        ids = entry[1] if entry is not None else torch.empty(size, dtype=torch.long,
                                                             device=self.device)
        ids[:num_tokens].copy_(token_ids)
        ids[num_tokens:].zero_()  # any id would do; zeros keep a prompt's answer its own
        self._last_index.fill_(num_tokens - 1)
        if entry is not None:
            entry[0].replay()
            return entry[2].clone()  # the pool's next replay may reuse the graph's output
        # This prompt runs as called on a side stream, as torch.cuda.graph wants its warm-up:
        # that warms every kernel up for this length (cuBLAS, cuDNN's plan, compiled groups).
        with side_stream(self.device):
            logits = self._run(kv, ids, self._last_index)
        logits.record_stream(torch.cuda.current_stream(self.device))  # the caller reads it there
        self._capture(key, kv, ids)
        return logits

    def _capture(self, key: tuple, kv: KVCache, ids: torch.Tensor) -> None:
        # Capturing runs nothing: the K/V and logits of the warm-up stay.
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._run(kv, ids, self._last_index)
        except RuntimeError as exc:
            # Something in the prefill syncs with the host; called prefills still work.
            log.warning("prefill graphs are off: capturing %d tokens failed (%s)", ids.shape[0],
                        exc)
            self.max_tokens = 0
            self.clear()
            return
        self._pool = graph.pool()
        self._graphs[key] = (graph, ids, logits)
        log.debug("captured a prefill graph of %d tokens (%d graphs)", ids.shape[0],
                  len(self._graphs))

    def clear(self) -> None:
        """Drop every graph and its memory pool (activations of the largest bucket)."""
        self._graphs.clear()
        self._pool = None
