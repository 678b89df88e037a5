"""How decode steps run: replayed from CUDA graphs, or called eagerly (CPU, or graphs off).

Both runners drive the same StaticStep. The graph runner keeps one graph per (KV buffers,
bucket, sampling key), captured lazily or by `prepare`; the arenas keep the KV addresses fixed
across release and refill, so graphs survive them. It copies each step's token into a pinned
ring slot behind an event and reads it one step later, so step i+1 is enqueued before the host
reads step i: the GPU never waits for Python. The eager runner reads each token as it comes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from strata.engine.core.fast.side_stream import side_stream
from strata.engine.core.fast.static_step import StaticStep, StepHook, bucket_for
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import TokenLogprob

log = logging.getLogger(__name__)

# Warm-up runs before capture: compiles Inductor kernels, creates cuBLAS workspaces.
WARMUP_STEPS = 2


class DecodeRunner(Protocol):
    """Runs a StaticStep: what GraphDecoder and constrained decoding drive."""

    def run_step(self, kv: KVCache, bucket: int, key: tuple) -> None:
        """Enqueue one step at the step's position (the step hook around it)."""

    def tokens(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
               buckets: Sequence[int], wants_logprobs: bool,
               ) -> Iterator[tuple[int, TokenLogprob | None]]:
        """Run num_tokens steps from start_pos; yield each sampled token and, when asked
        for, its logprob record."""

    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
                buckets: Sequence[int]) -> None:
        """Make ready ahead of time for decoding num_tokens from start_pos."""

    def clear(self) -> None:
        """Forget anything tied to the KV cache's or the weights' addresses."""


class EagerRunner:
    """Calls the step; reads each token back before the next step (a host sync per token)."""

    def __init__(self, step: StaticStep, hook: StepHook | None):
        self.step = step
        self.hook = hook

    def run_step(self, kv: KVCache, bucket: int, key: tuple) -> None:
        if self.hook is not None:
            self.hook.before_step()
        self.step.run(kv, bucket, key)
        if self.hook is not None:
            self.hook.after_step()

    def tokens(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
               buckets: Sequence[int], wants_logprobs: bool,
               ) -> Iterator[tuple[int, TokenLogprob | None]]:
        for i in range(num_tokens):
            self.run_step(kv, bucket_for(start_pos + i, buckets), key)
            token = int(self.step.token_out.item())
            yield token, self.step.sampler.read_logprob(token) if wants_logprobs else None

    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
                buckets: Sequence[int]) -> None:
        """Nothing to make ready: every step is called."""

    def clear(self) -> None:
        """Nothing kept."""


def warm_up(step: StaticStep, steps: int, run: Callable[[], None]) -> Callable[[], None]:
    """Runs one step (`run`) `steps` times on a side stream, as torch.cuda.graphs requires
    before a capture, each from the step's state as it is now; returns the function that
    puts that state back (after the capture too). The warm-up rewrites this position's K/V
    with the values the real step will write anyway."""
    saved = [t.clone() for t in step.state()]

    def restore() -> None:
        for dst, src in zip(step.state(), saved, strict=True):
            dst.copy_(src)

    with side_stream(step.device):
        for _ in range(steps):
            restore()
            run()
        restore()
    return restore


class GraphRunner:
    """Replays one CUDA graph per (KV buffers, bucket, key); reads tokens one step behind."""

    def __init__(self, step: StaticStep, hook: StepHook | None):
        self.step = step
        self.hook = hook
        # (KV addresses, bucket, sampling key) -> graph; read by tests.
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # With spread_capture, a graph not captured yet is not warmed up and captured inside
        # one step (WARMUP_STEPS + 1 passes of host work: ~160 ms for a 48-layer MoE, the
        # pause after a live shrink). Its first WARMUP_STEPS steps run eagerly instead, each
        # a real step that doubles as a warm-up, and the next one captures and replays.
        self.spread_capture = False
        self._eager_runs: dict[tuple, int] = {}
        self._pinned = torch.zeros(2, dtype=torch.long, pin_memory=True)
        self._pinned_logprobs = torch.zeros(2, step.sampler.logprob_row.shape[0],
                                            dtype=torch.float32, pin_memory=True)
        self._events = [torch.cuda.Event(), torch.cuda.Event()]

    @staticmethod
    def _key(kv: KVCache, bucket: int, key: tuple) -> tuple:
        return (tuple(t.data_ptr() for t in (*kv.k, *kv.v)), bucket, key)

    def graph(self, kv: KVCache, bucket: int, key: tuple, warmup_steps: int = WARMUP_STEPS,
              graph_key: tuple | None = None) -> torch.cuda.CUDAGraph:
        """The step's graph for this KV cache, bucket and key (graph_key: its _key, where the
        caller has it); captured on first use, after warmup_steps runs on a side stream."""
        graph_key = graph_key or self._key(kv, bucket, key)
        graph = self.graphs.get(graph_key)
        if graph is not None:
            return graph
        step = self.step
        restore = warm_up(step, warmup_steps, lambda: step.run(kv, bucket, key))
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every bucket: replays are serialized on one stream and every
        # output lands in buffers allocated outside the pool.
        with torch.cuda.graph(graph, pool=self._pool):
            step.run(kv, bucket, key)
        self._pool = graph.pool()
        restore()
        self.graphs[graph_key] = graph
        log.debug("captured decode graph for bucket %d (%d graphs)", bucket, len(self.graphs))
        return graph

    def run_step(self, kv: KVCache, bucket: int, key: tuple) -> None:
        if self.hook is not None:
            self.hook.before_step()  # before a capture too: that runs the step as well
        graph_key = self._key(kv, bucket, key)  # once a step: graph() takes it as is
        eager_runs = self._eager_runs.get(graph_key, 0) if self.spread_capture else 0
        if (self.spread_capture and graph_key not in self.graphs
                and eager_runs < WARMUP_STEPS):
            self._eager_runs[graph_key] = eager_runs + 1
            self.step.run(kv, bucket, key)  # the real step, and one of the capture's warm-ups
        else:
            self.graph(kv, bucket, key, WARMUP_STEPS - eager_runs, graph_key).replay()
        if self.hook is not None:
            self.hook.after_step()

    def tokens(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
               buckets: Sequence[int], wants_logprobs: bool,
               ) -> Iterator[tuple[int, TokenLogprob | None]]:
        if num_tokens <= 0:
            return
        step = self.step
        for i in range(num_tokens):
            self.run_step(kv, bucket_for(start_pos + i, buckets), key)
            slot = i % 2
            self._pinned[slot : slot + 1].copy_(step.token_out, non_blocking=True)
            if wants_logprobs:
                self._pinned_logprobs[slot].copy_(step.sampler.logprob_row, non_blocking=True)
            self._events[slot].record()
            if i > 0:
                yield self._read(1 - slot, wants_logprobs)
        yield self._read((num_tokens - 1) % 2, wants_logprobs)

    def _read(self, slot: int, wants_logprobs: bool) -> tuple[int, TokenLogprob | None]:
        self._events[slot].synchronize()
        token = int(self._pinned[slot])
        if not wants_logprobs:
            return token, None
        return token, self.step.sampler.read_logprob(token, self._pinned_logprobs[slot])

    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
                buckets: Sequence[int]) -> None:
        """Capture the graphs that decoding num_tokens from start_pos will use.

        Warm-up steps write K/V only at positions >= start_pos, which decoding rewrites before
        any step reads them."""
        last = min(start_pos + max(num_tokens, 1), kv.max_tokens) - 1
        first, final = bucket_for(start_pos, buckets), bucket_for(last, buckets)
        for bucket in [b for b in buckets if first <= b <= final]:
            self.step.token_in.zero_()
            self.step.position.fill_(min(start_pos, bucket - 1))
            self.graph(kv, bucket, key)

    def clear(self) -> None:
        """Drop every captured graph and their memory pool."""
        self.graphs.clear()
        self._eager_runs.clear()
        self._pool = None
