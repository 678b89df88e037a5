"""Decode steps cut where a partial cache's CPU-computed misses need the host
(fast/moe_cpu_misses.py, forward.decode_step_segments), run called or replayed.

A whole-step CUDA graph cannot wait for the host, so with cpu_expert_misses the step is cut
at each such MoE layer twice: after the router (the host splits the ids and starts the
CPU's misses) and after the hits' kernels (the host adds the CPU's sum into a fixed buffer).
`SplitEagerRunner` calls them with the host's work inline (StaticStep.run does that for
every step): on any device, what the graphs replay, and what CPU tests check against the
one-call path. `SplitGraphRunner` captures each segment as one graph (one pool for all)
and replays them with the host's work between; it is used only with
STRATA_CPU_MISS_GRAPHS=1 (its GPU tests pass, tests/gpu/test_cpu_expert_misses_cuda.py)
until a 30B row shows it pays: decode then costs 2 more graph launches and one sync a
split layer instead of a called step's every launch.
"""

from __future__ import annotations

import logging
import os

import torch

from strata.engine.core.fast.decode_runner import WARMUP_STEPS, EagerRunner, GraphRunner, warm_up
from strata.engine.core.fast.forward import HostWork
from strata.engine.core.kv_cache import KVCache

log = logging.getLogger(__name__)


def graphs_enabled() -> bool:
    """Whether decode with CPU-computed misses replays split graphs (STRATA_CPU_MISS_GRAPHS=1)."""
    return os.environ.get("STRATA_CPU_MISS_GRAPHS") == "1"


class SplitEagerRunner(EagerRunner):
    """EagerRunner over the split step: StaticStep.run already does the host's work between
    the segments; the name tells the decoder's choice (tests, the note)."""


class SplitGraphRunner(GraphRunner):
    """One CUDA graph per segment of the split step and (KV buffers, bucket, key); the host's
    work between replays. Tokens are read as GraphRunner reads them."""

    def __init__(self, step, hook):
        super().__init__(step, hook)
        # graph key -> (graphs, the host's work after each graph but the last); read by tests
        self.segments: dict[tuple, tuple[list[torch.cuda.CUDAGraph], list[HostWork]]] = {}

    def segment_graphs(self, kv: KVCache, bucket: int, key: tuple
                       ) -> tuple[list[torch.cuda.CUDAGraph], list[HostWork]]:
        """The step's segment graphs and the host's work between them; captured on first use."""
        graph_key = (tuple(t.data_ptr() for t in (*kv.k, *kv.v)), bucket, key)
        found = self.segments.get(graph_key)
        if found is not None:
            return found
        step = self.step
        restore = warm_up(step, WARMUP_STEPS, lambda: step.run(kv, bucket, key))
        graphs: list[torch.cuda.CUDAGraph] = []
        works: list[HostWork] = []
        segments = step.run_segments(kv, bucket, key)
        while True:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                work = next(segments, None)  # runs the segment up to the host's next work
            self._pool = graph.pool()
            graphs.append(graph)
            if work is None:
                break
            works.append(work)
        restore()
        self.segments[graph_key] = (graphs, works)
        log.debug("captured %d decode segments for bucket %d", len(graphs), bucket)
        return graphs, works

    def run_step(self, kv: KVCache, bucket: int, key: tuple) -> None:
        if self.hook is not None:
            self.hook.before_step()
        graphs, works = self.segment_graphs(kv, bucket, key)
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(works):
                works[i]()
        if self.hook is not None:
            self.hook.after_step()

    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, key: tuple,
                buckets) -> None:
        """Nothing ahead of time: segments are captured on first use."""

    def clear(self) -> None:
        """Drop every captured segment and their memory pool."""
        super().clear()
        self.segments.clear()
