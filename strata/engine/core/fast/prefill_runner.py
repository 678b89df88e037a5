"""A model's prefill on the fast path: a short fresh prompt replayed, everything else called.

A called prefill runs fast/prefill.py's chunks with the element-wise groups the load chose
(`ops`, tuning.choose_prefill_ops). A prompt at position 0 that a prefill graph takes
(prefill_graph.py, turned on by tuning.plan_prefill_graphs) is padded to its bucket and
replayed; a replay keeps the compiled groups whatever `ops` is, as a graph costs no host time
per op. In called chunks, a MoE model's quantized experts may replay their grouped path per
layer (expert_graphs.py), whatever the prompt's position.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.engine.core.fast.expert_graphs import ExpertGraphs
from strata.engine.core.fast.pointwise import PointwiseOps
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.fast.prefill_graph import PrefillGraphs
from strata.engine.core.kv_cache import KVCache


class PrefillRunner:
    """Prefill for one model: called chunks, or a replayed graph for a fresh short prompt."""

    def __init__(self, model: torch.nn.Module, moe_impl: str, ops: PointwiseOps,
                 chunk_tokens: int, is_capturable: bool):
        """is_capturable: the prefill holds no host sync (false for the MoE loop, which asks
        the host which experts run); fixed at load, as residency is, until a live shrink
        (use_expert_cache)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.moe_impl = moe_impl
        self.ops = ops
        self._graph_ops = ops
        self.chunk_tokens = chunk_tokens
        self.is_capturable = is_capturable
        self.graphs: PrefillGraphs | None = None
        self.expert_graphs: ExpertGraphs | None = None

    def called(self, kv: KVCache, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits [V] of the last of token_ids, by chunks called from Python (the quantized
        experts' grouped path replayed per layer where expert graphs are on)."""
        ops = self.ops
        if self.expert_graphs is not None:
            ops = replace(ops, grouped_experts=self.expert_graphs.experts_mlp)
        return prefill(self.model, kv, token_ids, start_pos, self.chunk_tokens, self.moe_impl,
                       ops)

    def padded(self, kv: KVCache, ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """A padded prompt at position 0, logits of row last_index: what a graph captures."""
        return prefill(self.model, kv, ids, 0, self.chunk_tokens, self.moe_impl,
                       self._graph_ops, last_index=last_index)

    def graph_bucket(self, kv: KVCache, num_tokens: int, start_pos: int) -> int | None:
        """The bucket a prefill graph replays this prompt at, or None: it runs called."""
        if self.graphs is None or start_pos != 0 or not self.is_capturable:
            return None
        return self.graphs.bucket(num_tokens, kv)

    def reach(self, kv: KVCache, num_tokens: int, start_pos: int) -> int:
        """How many positions prefilling num_tokens at start_pos writes K/V into: a replayed
        prompt writes its whole bucket (map that much first)."""
        size = self.graph_bucket(kv, num_tokens, start_pos)
        return size if size is not None else start_pos + num_tokens

    def run(self, kv: KVCache, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits [V] float32 of the last of token_ids [T] placed at start_pos.. (K/V written),
        replayed where a prefill graph takes the prompt."""
        graphs = self.graphs
        if (graphs is not None and token_ids.dim() == 1
                and self.graph_bucket(kv, token_ids.shape[0], start_pos) is not None):
            with torch.inference_mode():
                return graphs.run(kv, token_ids)
        return self.called(kv, token_ids, start_pos)

    def enable_graphs(self, max_tokens: int) -> None:
        """Replay fresh prompts of up to max_tokens (at most a chunk) from graphs; 0: off."""
        if max_tokens > self.chunk_tokens:
            raise ValueError(f"prefill graphs take at most a chunk of {self.chunk_tokens} "
                             f"tokens, not {max_tokens}")
        self.graphs = PrefillGraphs(self.padded, self.device, max_tokens) if max_tokens else None

    def enable_expert_graphs(self, top_k: int) -> None:
        """Replay the quantized experts' grouped path of called chunks per layer from CUDA
        graphs (expert_graphs.py; a model whose experts are all resident blocks)."""
        if not self.is_capturable or self.device.type != "cuda":
            raise ValueError("expert graphs need a CUDA prefill without host syncs")
        self.expert_graphs = ExpertGraphs(self.device, self.chunk_tokens, top_k)

    def use_expert_cache(self) -> None:
        """The MoE layers read a partial expert cache from now on (a live shrink): no more
        prefill or expert graphs, whose captures read the resident stacks; chunks are called."""
        self.drop_graphs()
        self.is_capturable = False
        self.graphs = None
        self.expert_graphs = None

    @property
    def graph_ops(self) -> PointwiseOps:
        """The element-wise groups prefill graphs capture (compiled, unless compiling was
        deferred and has not finished: deferred_compile.py)."""
        return self._graph_ops

    def set_ops(self, ops: PointwiseOps, graph_ops: PointwiseOps) -> None:
        """Called prefills run ops and graphs capture graph_ops from now on; graphs captured
        with other ops are dropped (the next fresh prompt captures again)."""
        self.ops = ops
        if graph_ops is not self._graph_ops:
            self._graph_ops = graph_ops
            self.drop_graphs()

    def drop_graphs(self) -> None:
        """Give the prefill and expert graphs' memory pools back; the next prompts capture
        again."""
        if self.graphs is not None:
            self.graphs.clear()
        if self.expert_graphs is not None:
            self.expert_graphs.clear()
