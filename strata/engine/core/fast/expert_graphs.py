"""The quantized experts' grouped prefill path (quant/expert_grouped.py) replayed per layer
from CUDA graphs.

Called from Python, that path costs the host about 130 launches a layer (8 groups of 16 of
Qwen3-30B-A3B's experts: three dequantizations, two row moves, an activation and two grouped
GEMMs each), far more than its GPU time (docs/benchmarks.md, run 17e: the host returned
after 6.1 of a 512-token layer's 6.2 ms, whose kernels took 1.5), so a long prompt's prefill
waited on Python. Every launch of it has a fixed grid and reads the routing from device
memory, so one graph per layer and row bucket replays any routing:

- The rows are padded to a power of two (the bucket); rows past the real ones lie past every
  expert's offsets, so no kernel reads or writes them, and one bucket serves every chunk
  length that pads to it (a long prompt's full chunks and its last).
- The inputs (x, the sorted rows' tokens and routing weights, the offsets) are copied into
  static buffers that every layer's graphs share, and the output goes to one static buffer:
  no graph keeps memory live between replays, so they share one pool, about one layer's
  intermediates at the largest bucket.
- The first call of a bucket for each kind of layer (the three projections' types and
  shapes) runs called, on a side stream as a capture wants its warm-up (the load compiled
  and tuned the kernels; this warms the GEMMs' shapes); every other (layer, bucket) is
  captured on its first call and replayed at once. A capture neither synchronizes nor
  empties torch's cache (torch.cuda.graph does both): a long prompt captures every layer.
- The output is valid until the next call: the MoE block sums it into token order at once.

On unless STRATA_EXPERT_GRAPHS=0 (`is_enabled`): on the Qwen3-30B-A3B Q4_K_M row they took
prefill 4096 from 0.95x to 1.86x llama.cpp and TTFT 512 from 72 to 58 ms (docs/benchmarks.md,
run 22a), for about 0.9 GiB more of torch's pools after a long prompt (the buckets' graphs).

Dropped with the prefill graphs (every release and sleep: PrefillRunner.drop_graphs), and
when the prefill scratch, whose address the graphs hold, is replaced; kept across expert
release and refill, which keep every address.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from strata.engine.core.fast.expert_epilogue import Epilogue
from strata.engine.core.fast.side_stream import side_stream
from strata.engine.core.quant import expert_grouped
from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.quant.weight import scratch_tensor

log = logging.getLogger(__name__)

MIN_BUCKET_ROWS = 1024


def is_enabled() -> bool:
    """Whether decoders replay the grouped path per layer (unless STRATA_EXPERT_GRAPHS=0)."""
    return os.environ.get("STRATA_EXPERT_GRAPHS", "1") != "0"


def bucket_rows(num_rows: int) -> int:
    """The rows a chunk of num_rows routed rows is padded to: a power of two."""
    return max(MIN_BUCKET_ROWS, 1 << max(0, num_rows - 1).bit_length())


@dataclass
class _Static:
    """The buffers every graph reads its inputs from and writes its output to."""

    x: torch.Tensor  # [max tokens, H]
    source: torch.Tensor  # [max rows] int64: each sorted row's token
    offsets: torch.Tensor  # [E] int32
    row_weights: torch.Tensor  # [max rows]
    out: torch.Tensor  # [max rows, H]
    row_experts: torch.Tensor  # [max rows] int64: each sorted row's expert (an epilogue's)


class ExpertGraphs:
    """expert_grouped.experts_mlp for chunks of up to max_tokens tokens, top_k rows each,
    replayed per (layer, row bucket) from CUDA graphs."""

    def __init__(self, device: torch.device, max_tokens: int, top_k: int):
        if max_tokens < 1 or top_k < 1:
            raise ValueError(f"max_tokens and top_k must be positive, not {max_tokens}, {top_k}")
        self.device = device
        self.max_tokens = max_tokens
        self.max_rows = max_tokens * top_k
        # (experts' addresses, bucket) -> graph
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._warm: set[tuple] = set()  # (the layer's kind, bucket) run called once
        self._static: _Static | None = None
        self._pool = None
        self._stream: torch.cuda.Stream | None = None  # warm-ups and captures run on it
        self._scratch_ptr = 0
        self.is_on = True  # off after a capture or the buffers failed: called from then on

    def __len__(self) -> int:
        return len(self._graphs)

    def experts_mlp(self, x: torch.Tensor, source: torch.Tensor, offsets: torch.Tensor,
                    row_weights: torch.Tensor, gate: QuantizedExperts, up: QuantizedExperts,
                    down: QuantizedExperts, epilogue: Epilogue | None = None,
                    row_experts: torch.Tensor | None = None) -> torch.Tensor:
        """What expert_grouped.experts_mlp returns, [R, H], replayed where a graph takes it;
        a replayed result is valid until the next call. epilogue and row_experts: GPT-OSS's
        expert biases and activation, as there (a layer's graph holds its own biases)."""
        num_tokens, num_rows = x.shape[0], source.shape[0]
        experts = (gate, up, down)
        called = (x, source, offsets, row_weights, *experts)
        extra = {"epilogue": epilogue, "row_experts": row_experts}
        if (not self.is_on or num_tokens > self.max_tokens or num_rows > self.max_rows
                or num_rows == 0 or torch.cuda.is_current_stream_capturing()):
            return expert_grouped.experts_mlp(*called, **extra)
        bucket = min(bucket_rows(num_rows), self.max_rows)
        self._check_scratch(x.device, gate, up, down)
        key = (gate.raw.data_ptr(), up.raw.data_ptr(), down.raw.data_ptr(), bucket)
        switches = tuple(epilogue.constexprs().values()) if epilogue is not None else ()
        kind = (*((w.qtype, w.shape, w.expert_stride) for w in experts), bucket, switches)
        if key not in self._graphs and kind not in self._warm:
            return self._warm_up(kind, called, extra)
        try:
            static = self._inputs(x, source, offsets, row_weights, row_experts)
        except torch.cuda.OutOfMemoryError as exc:  # a GPU shared to its last GiB
            self._turn_off(f"their buffers for {self.max_rows} rows do not fit ({exc})")
            return expert_grouped.experts_mlp(*called, **extra)
        if key not in self._graphs:
            self._capture(key, static, bucket, experts, epilogue)
            if key not in self._graphs:  # the capture failed (logged)
                return expert_grouped.experts_mlp(*called, **extra)
        self._graphs[key].replay()
        return static.out[:num_rows]

    def _check_scratch(self, device: torch.device, gate, up, down) -> None:
        """Drop the graphs if the prefill scratch they write into moved."""
        scratch = scratch_tensor(device, gate.dtype,
                                 (expert_grouped.scratch_numel(gate, up, down),))
        if scratch.data_ptr() != self._scratch_ptr:
            self._drop_graphs()
            self._scratch_ptr = scratch.data_ptr()

    def _inputs(self, x, source, offsets, row_weights, row_experts) -> _Static:
        """The static buffers, holding this call's inputs (allocated on first use)."""
        static = self._static
        num_experts, hidden = offsets.shape[0], x.shape[1]
        if (static is None or static.x.shape[1] != hidden or static.x.dtype != x.dtype
                or static.offsets.shape[0] != num_experts):
            self._drop_graphs()  # graphs read the buffers they were captured with
            static = self._static = _Static(
                x=torch.zeros(self.max_tokens, hidden, dtype=x.dtype, device=x.device),
                source=torch.zeros(self.max_rows, dtype=torch.long, device=x.device),
                offsets=torch.zeros(num_experts, dtype=torch.int32, device=x.device),
                row_weights=torch.zeros(self.max_rows, dtype=row_weights.dtype,
                                        device=x.device),
                out=torch.empty(self.max_rows, hidden, dtype=x.dtype, device=x.device),
                row_experts=torch.zeros(self.max_rows, dtype=torch.long, device=x.device))
        num_rows = source.shape[0]
        static.x[: x.shape[0]].copy_(x)
        static.source[:num_rows].copy_(source)
        static.offsets.copy_(offsets)
        static.row_weights[:num_rows].copy_(row_weights)
        if row_experts is not None:
            static.row_experts[:num_rows].copy_(row_experts)
        return static

    def _run(self, static: _Static, bucket: int, experts: tuple,
             epilogue: Epilogue | None) -> torch.Tensor:
        return expert_grouped.experts_mlp(
            static.x, static.source[:bucket], static.offsets, static.row_weights[:bucket],
            *experts, out=static.out[:bucket], epilogue=epilogue,
            row_experts=static.row_experts[:bucket] if epilogue is not None else None)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _warm_up(self, kind: tuple, called: tuple, extra: dict) -> torch.Tensor:
        """This call's answer, called on the side stream (a capture's warm-up); from now on
        layers of this kind capture at this bucket."""
        with side_stream(self.device, self._side_stream()):
            y = expert_grouped.experts_mlp(*called, **extra)
        y.record_stream(torch.cuda.current_stream(self.device))  # the caller reads it there
        self._warm.add(kind)
        return y

    def _capture(self, key: tuple, static: _Static, bucket: int, experts: tuple,
                 epilogue: Epilogue | None) -> None:
        """Capture this layer at this bucket (nothing runs); on failure, graphs go off."""
        graph = torch.cuda.CUDAGraph()
        try:
            with side_stream(self.device, self._side_stream()):
                graph.capture_begin(pool=self._pool)
                try:
                    self._run(static, bucket, experts, epilogue)
                finally:
                    graph.capture_end()
        except RuntimeError as exc:  # out of memory, or something in it syncs
            self._turn_off(f"capturing {bucket} rows failed ({exc})")
            return
        self._pool = graph.pool()
        self._graphs[key] = graph

    def _turn_off(self, reason: str) -> None:
        """Called from now on, holding nothing: the prefill goes on, slower."""
        log.warning("expert graphs are off: %s", reason)
        self.is_on = False
        self.clear()

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    def clear(self) -> None:
        """Drop every graph, their pool and the static buffers; the next calls warm up
        again (a release may also have dropped cuBLAS's workspaces)."""
        self._drop_graphs()
        self._warm.clear()
        self._static = None
