"""A decode step of B sequences at once, replayed from a CUDA graph per (batch, KV) bucket.

fast/decode_graph.py decodes one sequence; with B sequences decoding, eager torch launches
every kernel of the step from the host and the GPU waits on Python. Here the step reads fixed
device buffers (one token, one position and one cache offset per layer for each row), so a
graph captured once per bucket replays for any sequences in any slots:

- batch buckets 1, 2, 4, 8, 16: a batch is padded up to its bucket; a padding row has position
  -1 and writes nothing (batch_attention.py), its logits are ignored (a partial expert
  cache's promotion sees only the real rows' routing);
- KV buckets as for one sequence (static_step.kv_buckets): attention reads up to the bucket of
  the batch's furthest position, each row masked past its own.

Linear layers run on [B, hidden] (cuBLAS, or the quantized kernels at M = B), the fused
q/k/v and gate/up views where the model has them; MoE layers with the Triton kernels run the
batched decode kernels over the B*k (row, expert) pairs (moe_batch.py; quantized experts:
quant/expert_batch.py), resident or through a partial expert cache's slot table, other MoE
choices the prefill's grouped GEMMs. The step stops at the
logits [B, V]: each sequence samples with its own sampler, grammar and penalties (batch/).
Without CUDA (or with graphs off) the same step runs eagerly with the torch attention.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from strata.engine.core.fast import batch_attention
from strata.engine.core.fast.batch_experts import experts_rows
from strata.engine.core.fast.forward import (
    block_norms,
    linear,
    mlp_forward,
    project_head,
    project_qkv,
)
from strata.engine.core.fast.moe_grouped import is_grouped_capable, slot_layout
from strata.engine.core.fast.pointwise import PointwiseOps, apply_add_norm, apply_norm
from strata.engine.core.fast.side_stream import side_stream
from strata.engine.core.fast.static_step import (
    DEFAULT_MIN_BUCKET_TOKENS,
    StepHook,
    bucket_for,
    kv_buckets,
)
from strata.engine.core.kv_cache import KVCache, check_positions
from strata.engine.core.models.switch import SparseMoE

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16)
MAX_BATCH_ROWS = BATCH_BUCKETS[-1]
WARMUP_STEPS = 2  # before a capture: compiles, creates cuBLAS workspaces (decode_runner.py)


def batch_bucket(num_rows: int) -> int:
    """The smallest batch bucket that holds num_rows sequences."""
    if num_rows < 1:
        raise ValueError(f"a batch step takes 1..{MAX_BATCH_ROWS} sequences, not {num_rows}")
    for size in BATCH_BUCKETS:
        if num_rows <= size:
            return size
    raise ValueError(f"a batch step takes 1..{MAX_BATCH_ROWS} sequences, not {num_rows}")


class KVRows:
    """Where each slot's caches sit, as element offsets from one base cache per layer.

    The kv arena keeps every slot's address fixed, so a slot's offsets never change and a
    graph that bakes the base addresses in stays valid across release and refill."""

    def __init__(self, base: KVCache):
        self.base = base
        self._cached: dict[int, tuple[KVCache, list[int]]] = {}

    def offsets(self, kv: KVCache) -> list[int]:
        """[k of layer 0.., v of layer 0..]: kv's caches minus the base's, in elements."""
        hit = self._cached.get(id(kv))
        if hit is not None and hit[0] is kv:
            return hit[1]
        if kv.num_layers != self.base.num_layers or kv.dtype != self.base.dtype:
            raise ValueError("every row of a batch needs a KV cache of the same model")
        size = kv.dtype.itemsize
        found = []
        for mine, base in ((kv.k, self.base.k), (kv.v, self.base.v)):
            for tensor, origin in zip(mine, base, strict=True):
                delta = tensor.data_ptr() - origin.data_ptr()
                if delta % size:
                    raise ValueError("a KV cache is not aligned to its dtype")
                found.append(delta // size)
        if len(self._cached) >= 256:  # slots' caches are few; never grow without bound
            self._cached.clear()
        self._cached[id(kv)] = (kv, found)
        return found


class BatchBuffers:
    """The fixed device buffers of one batch bucket, filled by one host-to-device copy."""

    def __init__(self, rows: int, num_layers: int, vocab_size: int, device: torch.device):
        self.rows = rows
        is_cuda = device.type == "cuda"
        # Row 0: tokens; row 1: positions; then K offsets per layer, then V offsets.
        self.host = torch.zeros(2 + 2 * num_layers, rows, dtype=torch.long,
                                pin_memory=is_cuda)
        self.device_ids = torch.zeros_like(self.host, device=device)
        self.tokens = self.device_ids[0]
        self.positions = self.device_ids[1]
        self.k_offsets = self.device_ids[2 : 2 + num_layers]
        self.v_offsets = self.device_ids[2 + num_layers :]
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=device)
        self.kvs: list[KVCache | None] = [None] * rows  # the rows' caches (the torch path)
        self.host_positions: list[int] = [batch_attention.PAD_POSITION] * rows

    def load(self, tokens: Sequence[int], positions: Sequence[int], kvs: Sequence[KVCache],
             kv_rows: KVRows) -> None:
        """Fill the first len(tokens) rows; the rest become padding."""
        num = len(tokens)
        host = self.host
        host[0].zero_()
        host[1].fill_(batch_attention.PAD_POSITION)
        host[2:].zero_()  # padding rows point at the base cache (and never touch it)
        host[0, :num] = torch.tensor(list(tokens), dtype=torch.long)
        host[1, :num] = torch.tensor(list(positions), dtype=torch.long)
        host[2:, :num] = torch.tensor([kv_rows.offsets(kv) for kv in kvs],
                                      dtype=torch.long).T
        # Blocking: the host refills this staging buffer for the next step (or the next group
        # of a batch over 16 rows) right away, and the step's tokens are awaited anyway.
        self.device_ids.copy_(host)
        self.kvs = [*kvs, *[None] * (self.rows - num)]
        self.host_positions = [*positions, *[batch_attention.PAD_POSITION] * (self.rows - num)]


def is_capturable(model: torch.nn.Module, moe_impl: str) -> bool:
    """Whether a batch step of this model holds no host sync (a graph can capture it): every
    MoE layer reads its experts by ids in device memory, resident or through a partial
    cache's slot table; not the loop module, which asks the host which experts run."""
    moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    return not moe_layers or (moe_impl != "loop" and all(is_grouped_capable(m, moe_impl)
                                                         for m in moe_layers))


def _mlp_rows(mlp, x: torch.Tensor, ops: PointwiseOps, moe_impl: str) -> torch.Tensor:
    """The feed-forward of rows x [B, H]. With the Triton MoE the batched decode kernels
    (moe_batch.py; quantized: quant/expert_batch.py) read only the routed experts, each once
    a step, resident or through a partial cache's slot table; one row takes the one-token
    kernels. A provider without a slot table keeps the loop module."""
    if isinstance(mlp, SparseMoE) and moe_impl == "triton" and x.shape[0] > 1:
        if mlp.expert_weights is None:
            return experts_rows(mlp, x)
        layout = slot_layout(mlp)
        if layout is not None:
            return experts_rows(mlp, x, layout)
    return mlp_forward(mlp, x, ops, moe_impl)


class BatchStep:
    """The batched step itself (`run`), over one bucket's buffers."""

    def __init__(self, model: torch.nn.Module, ops: PointwiseOps, moe_impl: str,
                 fused_attention: bool):
        self.model = model
        # One token's Triton GEMVs and norms take one row; a batch uses cuBLAS and the groups.
        self.ops = dataclasses.replace(ops, dense_kernels=False, fused_attention=False,
                                       pdl=False)
        self.moe_impl = moe_impl
        self.fused_attention = fused_attention

    def run(self, buffers: BatchBuffers, kv_rows: KVRows, num_keys: int) -> None:
        """Logits of every row into buffers.logits; writes each real row's K/V. No host sync
        on the fused path: a graph can hold it."""
        model, ops = self.model, self.ops
        # Per layer: cos, sin [B, D] each (one table unless Gemma's two).
        positions = buffers.positions.clamp(min=0)  # [B]; padding rows at 0
        ropes = model.layer_ropes(positions, per_row=True)
        h = model.embed(buffers.tokens)  # [B, H]
        y = None
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            cos, sin = ropes[i]
            h, x = apply_add_norm(ops, h, y, layer.input_layernorm)
            q, k, v = project_qkv(attn, x, ops)  # [B, Hq*D], [B, Hkv*D] x2
            q = attn.scale_queries(q, positions)  # Ministral 3's temperature; RoPE is linear
            if self.fused_attention:
                out = batch_attention.batch_attention(
                    attn, q, k, v, cos, sin, kv_rows.base.k[i], kv_rows.base.v[i],
                    buffers.k_offsets[i], buffers.v_offsets[i], buffers.positions, num_keys)
            else:
                kvs = buffers.kvs
                out = batch_attention.reference_batch_attention(
                    attn, q, k, v, cos, sin, [None if kv is None else kv.k[i] for kv in kvs],
                    [None if kv is None else kv.v[i] for kv in kvs], buffers.host_positions,
                    num_keys, ops)
            y = linear(out, attn.o_proj.weight, attn.o_proj.bias, ops)
            after_attn, before_mlp, after_mlp = block_norms(layer)
            if after_attn is not None:  # Gemma's sandwich: the sublayer's output normed too
                y = apply_norm(ops, y, after_attn)
            h, x = apply_add_norm(ops, h, y, before_mlp)
            y = _mlp_rows(layer.mlp, x, ops, self.moe_impl)
            if after_mlp is not None:
                y = apply_norm(ops, y, after_mlp)
        _, x = apply_add_norm(ops, h, y, model.model.norm)
        buffers.logits.copy_(project_head(x, model))  # [B, V]


class BatchDecoder:
    """Batched decode steps for one model: graphs per (batch bucket, KV bucket) on CUDA."""

    def __init__(self, model: torch.nn.Module, ops: PointwiseOps, moe_impl: str, *,
                 use_cuda_graphs: bool, fused_attention: bool,
                 min_bucket_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
                 step_hook: StepHook | None = None):
        """step_hook: called around every step (a partial expert cache's promotion)."""
        self.model = model
        self.device = next(model.parameters()).device
        if use_cuda_graphs and not fused_attention:
            raise ValueError("batch graphs need the batched attention kernels (positions "
                             "stay on the device)")
        self.use_cuda_graphs = use_cuda_graphs
        self.step_hook = step_hook
        self.step = BatchStep(model, ops, moe_impl, fused_attention)
        self.min_bucket_tokens = min_bucket_tokens
        self._buffers: dict[int, BatchBuffers] = {}
        self._kv_rows: KVRows | None = None
        # (batch bucket, KV bucket, base addresses) -> graph; read by tests.
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], positions: Sequence[int],
                kvs: Sequence[KVCache]) -> torch.Tensor:
        """Logits [n, V] float32 for token b at positions[b] of kvs[b] (K/V written there).

        The result is a view of the bucket's buffer: read it before the next forward."""
        num = len(tokens)
        if not 0 < num <= MAX_BATCH_ROWS or len(positions) != num or len(kvs) != num:
            raise ValueError(f"a batch step takes 1..{MAX_BATCH_ROWS} rows of token, position "
                             f"and KV cache; got {num}, {len(positions)}, {len(kvs)}")
        check_positions(positions, kvs)
        if self._kv_rows is None:
            self._kv_rows = KVRows(kvs[0])
        rows = batch_bucket(num)
        buffers = self._buffers.get(rows)
        if buffers is None:
            buffers = BatchBuffers(rows, len(kvs[0].k), self.model.config.vocab_size,
                                   self.device)
            self._buffers[rows] = buffers
        buffers.load(tokens, positions, kvs, self._kv_rows)
        num_keys = bucket_for(max(positions),
                              kv_buckets(kvs[0].max_tokens, self.min_bucket_tokens))
        if self.step_hook is not None:
            self.step_hook.before_step()  # before a capture too: that runs the step as well
        if self.use_cuda_graphs:
            self._graph(buffers, num_keys).replay()
        else:
            self.step.run(buffers, self._kv_rows, num_keys)
        if self.step_hook is not None:
            self.step_hook.after_step(num)  # the real rows' routing, not the padding's
        return buffers.logits[:num]

    def _graph(self, buffers: BatchBuffers, num_keys: int) -> torch.cuda.CUDAGraph:
        base = self._kv_rows.base
        key = (buffers.rows, num_keys, tuple(t.data_ptr() for t in (*base.k, *base.v)))
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        # Warm-up on a side stream, as torch.cuda.graphs requires: it writes the real rows'
        # K/V with the values the replay writes anyway.
        with side_stream(self.device):
            for _ in range(WARMUP_STEPS):
                self.step.run(buffers, self._kv_rows, num_keys)
        graph = torch.cuda.CUDAGraph()
        # One pool for every bucket: replays are serialized on one stream and the logits land
        # in a buffer allocated outside it.
        with torch.cuda.graph(graph, pool=self._pool):
            self.step.run(buffers, self._kv_rows, num_keys)
        self._pool = graph.pool()
        self.graphs[key] = graph
        log.debug("captured a batch decode graph: %d rows, %d keys (%d graphs)", buffers.rows,
                  num_keys, len(self.graphs))
        return graph

    def clear(self) -> None:
        """Drop every graph and their memory pool (sleep); the next step captures again."""
        self.graphs.clear()
        self._pool = None
