"""Batch-1 decoding with one CUDA graph per KV-length bucket, replayed per token.

A graph holds one whole decode step: embedding, every layer, the head and the sampler. Its
inputs are static device buffers (token id, position, sampler state) and the step itself
writes the sampled token back into the token buffer and advances the position, so step i+1 is
enqueued before the host has read step i's token: the host copies each token into a pinned
ring slot behind an event and reads it one step later. The GPU never waits for Python.

Attention in a graph reads a fixed number of cache slots, so there is one graph per
power-of-two bucket of KV length (masking slots after the position): a step reads about the
used length, not the whole context. Graphs are captured lazily (or by `prepare`) and keyed by
the KV buffers' addresses; the arenas keep those addresses fixed across release and refill.
Without CUDA (or with graphs off) the same step runs eagerly, which is what CPU tests check.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Protocol

import torch

from strata.engine.core.fast import decode_dense, pdl
from strata.engine.core.fast.decode_attention import check_fused
from strata.engine.core.fast.forward import decode_step
from strata.engine.core.fast.graph_sampler import GraphSampler, sampling_key
from strata.engine.core.fast.moe_grouped import is_grouped_capable, select_moe_impl
from strata.engine.core.fast.pointwise import EAGER_OPS, compiled_ops
from strata.engine.core.fast.prefill import DEFAULT_PREFILL_CHUNK_TOKENS, prefill
from strata.engine.core.fast.prefill_attention import flash_attention
from strata.engine.core.fast.prefill_graph import MIN_BUCKET_TOKENS, PrefillGraphs, graph_tokens
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.switch import SparseMoE
from strata.engine.protocol import SamplingSpec

log = logging.getLogger(__name__)

DEFAULT_MIN_BUCKET_TOKENS = 256
# The graph key of a step that stops at the logits (constrained decoding samples outside).
LOGITS_KEY = ("logits",)
# Warm-up runs before capture: compiles Inductor kernels, creates cuBLAS workspaces.
WARMUP_STEPS = 2


class StepHook(Protocol):
    """Work around each decode step, on the host, never inside a graph (an expert cache's
    promotion: memory/expert_promotion.py)."""

    def before_step(self) -> None:
        """Raise to refuse the step (its memory is released); else make ready for it."""

    def after_step(self) -> None:
        """The step is queued (maybe not run): note what it will have used."""


def kv_buckets(max_tokens: int, min_bucket_tokens: int = DEFAULT_MIN_BUCKET_TOKENS) -> list[int]:
    """KV-length buckets: powers of two from min_bucket_tokens, the last one max_tokens."""
    if max_tokens <= 0 or min_bucket_tokens <= 0:
        raise ValueError(f"max_tokens and min_bucket_tokens must be positive, not "
                         f"{max_tokens}, {min_bucket_tokens}")
    buckets, size = [], min_bucket_tokens
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return buckets


def bucket_for(position: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `position` (bucket sizes count slots 0..size-1)."""
    for size in buckets:
        if position < size:
            return size
    raise ValueError(f"position {position} is past the KV cache of {buckets[-1]} tokens")


# Eager prefill groups replace compiled ones only when this much faster: the two timings are
# taken back to back on a GPU that other programs may be using.
EAGER_PREFILL_MARGIN = 0.05


def faster_prefill_ops(seconds: dict[str, float]) -> str:
    """"eager" when its chunk took at least EAGER_PREFILL_MARGIN less time than compiled's."""
    return "eager" if seconds["eager"] < seconds["compiled"] * (1 - EAGER_PREFILL_MARGIN) \
        else "compiled"


class GraphDecoder:
    """Prefill and decode for one model; CUDA graphs on a GPU, the same step eagerly elsewhere."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        use_cuda_graphs: bool | None = None,
        compile_pointwise: bool | None = None,
        moe_impl: str = "auto",
        min_bucket_tokens: int = DEFAULT_MIN_BUCKET_TOKENS,
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        fused_attention: bool | None = None,
        dense_kernels: bool | None = None,
        step_hook: StepHook | None = None,
    ):
        """step_hook: called around every decode step; used only by the grouped MoE paths
        (a partial expert cache's promotion; its loop path moves experts itself)."""
        self.model = model
        self.device = next(model.parameters()).device
        is_cuda = self.device.type == "cuda"
        if use_cuda_graphs and not is_cuda:
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")
        self.use_cuda_graphs = is_cuda if use_cuda_graphs is None else use_cuda_graphs
        self.moe_impl = "loop"
        self.note = ""
        moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if moe_layers:
            self.moe_impl = select_moe_impl(moe_impl, self.device)
            if not all(is_grouped_capable(m, self.moe_impl) for m in moe_layers):
                self.moe_impl = "loop"
                self._add_note("an expert cache the Triton kernels cannot read: MoE loop")
            if self.moe_impl == "loop" and self.use_cuda_graphs:
                # The loop asks the host which experts run: a sync, which a graph cannot hold.
                self.use_cuda_graphs = False
                self._add_note("MoE loop: no CUDA graph")
        self.step_hook = step_hook if self.moe_impl != "loop" else None
        # A prefill graph cannot hold the MoE loop, which asks the host which experts run: a
        # partial expert cache prefills through it whatever decode uses. Fixed at load, as
        # residency is.
        self._prefill_capturable = not moe_layers or (
            self.moe_impl != "loop" and all(m.expert_weights is None for m in moe_layers))
        self.ops = self.prefill_ops = EAGER_OPS
        if compile_pointwise if compile_pointwise is not None else is_cuda:
            self.ops = compiled_ops()
            self.prefill_ops = compiled_ops(dynamic=True)  # chunk lengths vary per prompt
        # A graph costs no host time per op: it keeps the fused groups whatever a called
        # prefill chooses (choose_prefill_ops).
        self._graph_prefill_ops = self.prefill_ops
        # Fresh prompts replayed from graphs (prefill_graph.py): set by plan_prefill_graphs.
        self.prefill_graphs: PrefillGraphs | None = None
        if fused_attention if fused_attention is not None else is_cuda:
            self._enable_fused_attention()
        if dense_kernels if dense_kernels is not None else is_cuda:
            self._enable_dense_kernels()
        self.min_bucket_tokens = min_bucket_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.sampler = GraphSampler(model.config.vocab_size, self.device,
                                    min(model.config.max_position_embeddings, 1 << 17))
        self.last_logprob = None  # TokenLogprob of the token last yielded, when asked for
        self.token_in = torch.zeros(1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.token_out = torch.zeros(1, dtype=torch.long, device=self.device)
        self.logits_out = torch.zeros(model.config.vocab_size, dtype=torch.float32,
                                      device=self.device)  # [V], read by constrained_decode
        self._key_positions: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        if is_cuda:
            self._pinned = torch.zeros(2, dtype=torch.long, pin_memory=True)
            self._pinned_logprobs = torch.zeros(2, self.sampler.logprob_row.shape[0],
                                                dtype=torch.float32, pin_memory=True)
            self._events = [torch.cuda.Event(), torch.cuda.Event()]

    def _add_note(self, text: str) -> None:
        """Append to `note`, what the decoder runs differently from its defaults, and why."""
        self.note = f"{self.note}; {text}" if self.note else text

    def _enable_fused_attention(self) -> None:
        """Turn on the Triton decode attention if it matches the torch one on this device."""
        attn = self.model.model.layers[0].self_attn
        dtype = next(self.model.parameters()).dtype
        reason = check_fused(attn, dtype, self.device)
        if reason:
            log.warning("fused decode attention off (%s); decoding with torch attention", reason)
            self._add_note("torch attention")
            return
        self.ops = dataclasses.replace(self.ops, fused_attention=True)

    def _enable_dense_kernels(self) -> None:
        """Turn on decode_dense's kernels, and PDL where the GPU has it, if they match torch."""
        use_pdl = pdl.is_supported(self.device)
        reason = decode_dense.check_kernels(self.model, use_pdl)
        if reason:
            log.warning("Triton projections and norms off (%s); decoding with torch", reason)
            self._add_note("torch projections")
            return
        self.ops = dataclasses.replace(self.ops, dense_kernels=True, pdl=use_pdl)

    # ---- the step and its graphs -------------------------------------------------------------

    def _keys(self, bucket: int) -> torch.Tensor:
        if bucket not in self._key_positions:
            self._key_positions[bucket] = torch.arange(bucket, device=self.device)
        return self._key_positions[bucket]

    def _step(self, kv: KVCache, bucket: int, key: tuple) -> None:
        ops = self.ops
        if ops.fused_attention and kv.k[0].dtype != self.model.model.embed_tokens.weight.dtype:
            ops = dataclasses.replace(ops, fused_attention=False)  # the kernels need one dtype
        logits = decode_step(
            self.model, kv, self.token_in, self.position, self._keys(bucket), ops, self.moe_impl,
        )
        if key == LOGITS_KEY:  # a constrained request samples after the graph, with its mask
            self.logits_out.copy_(logits[0])
            self.position.add_(1)
            return
        token = self.sampler.sample(logits, key)  # [1]
        self.token_out.copy_(token)
        self.token_in.copy_(token)
        self.position.add_(1)

    def _state(self) -> list[torch.Tensor]:
        window = self.sampler.window
        return [self.token_in, self.position, self.token_out, self.sampler.step,
                window.ring, window.counts, window.pos]

    def _graph(self, kv: KVCache, bucket: int, key: tuple) -> torch.cuda.CUDAGraph:
        graph_key = (tuple(t.data_ptr() for t in (*kv.k, *kv.v)), bucket, key)
        graph = self._graphs.get(graph_key)
        if graph is not None:
            return graph
        saved = [t.clone() for t in self._state()]

        def restore() -> None:
            for dst, src in zip(self._state(), saved):
                dst.copy_(src)

        # Warm up on a side stream as torch.cuda.graphs requires. The warm-up rewrites this
        # position's K/V with the values the real step will write anyway.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                restore()
                self._step(kv, bucket, key)
            restore()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One memory pool for every bucket: replays are serialized on one stream and every
        # output lands in buffers allocated outside the pool.
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(kv, bucket, key)
        self._pool = graph.pool()
        restore()
        self._graphs[graph_key] = graph
        log.debug("captured decode graph for bucket %d (%d graphs)", bucket, len(self._graphs))
        return graph

    def tune_prefill(self, graphs: bool = True) -> dict:
        """What a load does before the first request: compile (warm_up_prefill), keep the
        faster element-wise groups for called prefills (choose_prefill_ops), then turn on
        prefill graphs where they pay (plan_prefill_graphs; graphs=False: never). Returns
        what each found."""
        return {"warm_up_s": self.warm_up_prefill(), "ops_s": self.choose_prefill_ops(),
                "graphs": self.plan_prefill_graphs() if graphs else {}}

    @torch.inference_mode()
    def warm_up_prefill(self, num_tokens: int = 23) -> float:
        """Compile the prefill's element-wise groups now (one short prefill into a scratch
        cache), so the first request does not pay it: the first 32k-token prompt after a load
        took 1.8 s against 0.75 s without compiled groups (H200). Returns the seconds spent.

        One pass covers every later prompt: the groups compile for any token count (and
        separately for the one-row last layer), and the MoE blocks of the later layers
        compile once the first layer has shown that grouped GEMMs run here. num_tokens is a
        prime so that it equals no model dimension: torch.compile assumes sizes that are equal
        when it compiles stay equal ("duck sizing"), and 16 tokens with head_dim 16 compiled a
        variant that no other length could use."""
        if not self.prefill_ops.is_compiled:
            return 0.0
        started_s = time.perf_counter()
        config = self.model.config
        dtype = next(self.model.parameters()).dtype
        kv = KVCache.for_config(config, num_tokens, dtype, self.device)
        ids = torch.arange(num_tokens, device=self.device) % config.vocab_size
        self._called_prefill(kv, ids, 0)
        if self.device.type == "cuda":
            # cuDNN's plan for a full chunk's attention (45-75 ms to build, once per length).
            attn = self.model.model.layers[0].self_attn
            chunk, head_dim = self.prefill_chunk_tokens, attn.head_dim
            # Laid out as attention_prefill passes them ([T, heads, D] transposed), in case
            # cuDNN keys its plans on strides as well as shapes.
            def rows(num_heads: int) -> torch.Tensor:
                return torch.zeros(chunk, num_heads, head_dim, dtype=dtype,
                                   device=self.device).transpose(0, 1)

            keys = rows(attn.num_kv_heads)
            flash_attention(rows(attn.num_heads), keys, keys, prefer_cudnn=True)
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started_s

    @torch.inference_mode()
    def choose_prefill_ops(self, repeats: int = 2) -> dict[str, float]:
        """Keep the compiled prefill groups only where they beat eager ones here.

        A compiled call costs ~100 us of host time against ~10 us for an eager op, so for a
        small model the host decides and for a large one the fused kernels do. On an H200
        (bench/diag_prefill_ops.py), one 4096-token chunk took 34.2 ms eager against 41.1 ms
        compiled for SmolLM2-135M, 122 against 103 ms for Llama-3-8B and 131 against 77 ms
        for Qwen3-30B-A3B. One full chunk each way, best of `repeats` after a warm run; the MoE
        block stays compiled either way. Returns the seconds of each ({} when nothing is
        compiled) and leaves `prefill_ops` at the faster (`faster_prefill_ops`)."""
        if not self.prefill_ops.is_compiled:
            return {}
        compiled = self.prefill_ops
        eager = dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)
        kv, ids = self._scratch_chunk()
        seconds: dict[str, float] = {}
        for name, ops in (("compiled", compiled), ("eager", eager)):
            self.prefill_ops = ops
            seconds[name] = self._best_s(partial(self._called_prefill, kv, ids, 0), repeats + 1)
        self.prefill_ops = eager if faster_prefill_ops(seconds) == "eager" else compiled
        del kv
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the probe's cache and activations go back
        return seconds

    def _scratch_chunk(self) -> tuple[KVCache, torch.Tensor]:
        """A KV cache for one full chunk and a chunk of token ids, for timing probes."""
        config = self.model.config
        dtype = next(self.model.parameters()).dtype
        chunk = min(self.prefill_chunk_tokens, config.max_position_embeddings)
        kv = KVCache.for_config(config, chunk, dtype, self.device)
        return kv, torch.arange(chunk, device=self.device) % config.vocab_size

    def _best_s(self, fn, runs: int) -> float:
        """Wall seconds of the fastest of `runs` calls of fn, each between device syncs."""
        best_s = float("inf")
        for _ in range(runs):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            started_s = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best_s = min(best_s, time.perf_counter() - started_s)
        return best_s

    @torch.inference_mode()
    def plan_prefill_graphs(self, repeats: int = 2) -> dict[str, float]:
        """Measure where replaying a fresh prompt's prefill from a graph beats calling it, and
        turn prefill graphs on up to that length (prefill_graph.py).

        Times a full chunk replayed from a graph and a MIN_BUCKET_TOKENS prompt called (the
        host's time; its GPU work is small), best of `repeats` after a warm run, in a scratch
        cache whose graph and pool are dropped after. Returns both and the longest prompt
        that takes a graph (graph_tokens); {} where graphs are off or cannot run."""
        self.prefill_graphs = None
        if not self.use_cuda_graphs or not self._prefill_capturable:
            return {}
        kv, ids = self._scratch_chunk()
        chunk = ids.shape[0]
        probe = PrefillGraphs(self._padded_prefill, self.device, chunk)
        replay_s = self._best_s(partial(probe.run, kv, ids), repeats + 1)
        if not probe.max_tokens:  # the capture failed (logged): called prefills only
            return {}
        host_s = self._best_s(partial(self._called_prefill, kv, ids[:MIN_BUCKET_TOKENS], 0),
                              repeats + 1)
        probe.clear()
        del kv
        torch.cuda.empty_cache()
        max_tokens = graph_tokens(host_s, replay_s, chunk)
        self.enable_prefill_graphs(max_tokens)
        return {"chunk_replay_s": replay_s, "host_s": host_s, "graph_tokens": max_tokens}

    def enable_prefill_graphs(self, max_tokens: int) -> None:
        """Replay fresh prompts of up to max_tokens (at most a chunk) from graphs; 0: off."""
        if max_tokens > self.prefill_chunk_tokens:
            raise ValueError(f"prefill graphs take at most a chunk of {self.prefill_chunk_tokens} "
                             f"tokens, not {max_tokens}")
        if max_tokens and not self.use_cuda_graphs:
            raise ValueError("prefill graphs need CUDA graphs, which this decoder does not use")
        self.prefill_graphs = (PrefillGraphs(self._padded_prefill, self.device, max_tokens)
                               if max_tokens else None)

    def _padded_prefill(self, kv: KVCache, ids: torch.Tensor,
                        last_index: torch.Tensor) -> torch.Tensor:
        return prefill(self.model, kv, ids, 0, self.prefill_chunk_tokens, self.moe_impl,
                       self._graph_prefill_ops, last_index=last_index)

    def _graph_bucket(self, kv: KVCache, num_tokens: int, start_pos: int) -> int | None:
        """The bucket a prefill graph replays this prompt at, or None: it runs called."""
        graphs = self.prefill_graphs
        if graphs is None or start_pos != 0 or not self._prefill_capturable:
            return None
        return graphs.bucket(num_tokens, kv)

    def prefill_reach(self, kv: KVCache, num_tokens: int, start_pos: int) -> int:
        """How many positions prefilling num_tokens at start_pos writes K/V into: a replayed
        prompt writes its whole bucket (map that much first)."""
        size = self._graph_bucket(kv, num_tokens, start_pos)
        return size if size is not None else start_pos + num_tokens

    def drop_prefill_graphs(self) -> None:
        """Give the prefill graphs' memory pool back; the next fresh prompt captures again."""
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()

    def clear(self) -> None:
        """Drop every captured graph (e.g. after the KV cache or the weights moved)."""
        self._graphs.clear()
        self._pool = None

    @torch.inference_mode()
    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, spec: SamplingSpec) -> None:
        """Capture, ahead of time, the graphs that decoding num_tokens from start_pos will use.

        Warm-up steps write K/V only at positions >= start_pos, which decoding rewrites before
        any step reads them.
        """
        if not self.use_cuda_graphs:
            return
        key = sampling_key(spec)
        buckets = kv_buckets(kv.max_tokens, self.min_bucket_tokens)
        last = min(start_pos + max(num_tokens, 1), kv.max_tokens) - 1
        first, final = bucket_for(start_pos, buckets), bucket_for(last, buckets)
        for bucket in [b for b in buckets if first <= b <= final]:
            self.token_in.zero_()
            self.position.fill_(min(start_pos, bucket - 1))
            self._graph(kv, bucket, key)

    # ---- generation ---------------------------------------------------------------------------

    def prefill(self, kv: KVCache, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits [V] float32 of the last of token_ids [T] placed at start_pos.. (K/V written).

        A fresh prompt that a prefill graph takes is replayed; K/V are then written up to
        `prefill_reach` positions."""
        if (token_ids.dim() == 1
                and self._graph_bucket(kv, token_ids.shape[0], start_pos) is not None):
            with torch.inference_mode():
                return self.prefill_graphs.run(kv, token_ids)
        return self._called_prefill(kv, token_ids, start_pos)

    def _called_prefill(self, kv: KVCache, token_ids: torch.Tensor,
                        start_pos: int) -> torch.Tensor:
        return prefill(self.model, kv, token_ids, start_pos, self.prefill_chunk_tokens,
                       self.moe_impl, self.prefill_ops)

    @torch.inference_mode()
    def sample_first(self, logits: torch.Tensor, spec: SamplingSpec,
                     history: Sequence[int] = ()) -> int:
        """Start a request: load its sampling state and draw the first token from logits [V].
        history: the prompt's token ids (the penalty window starts with them)."""
        self.sampler.prepare(spec, history)
        token = int(self.sampler.sample(logits[None], sampling_key(spec)).item())
        self.last_logprob = (self.sampler.read_logprob(token)
                             if spec.num_logprobs is not None else None)
        return token

    @torch.inference_mode()
    def decode(
        self,
        kv: KVCache,
        first_token: int,
        start_pos: int,
        max_new_tokens: int,
        spec: SamplingSpec,
        *,
        continue_request: bool = False,
        history: Sequence[int] = (),
    ) -> Iterator[int]:
        """Feed first_token at start_pos, then yield max_new_tokens sampled tokens.

        Token i+1 is already enqueued when token i is yielded, so a caller that stops early
        leaves K/V written one position past its last token (harmless: the slot's token
        history says what is valid). continue_request keeps the sampler state of
        `sample_first` instead of starting a new one. With spec.num_logprobs, `last_logprob`
        holds the yielded token's record when it is yielded.
        """
        if max_new_tokens <= 0:
            return
        if start_pos < 0 or start_pos + max_new_tokens > kv.max_tokens:
            raise ValueError(
                f"decoding {max_new_tokens} tokens from position {start_pos} does not fit the "
                f"KV cache of {kv.max_tokens} tokens: ask for fewer tokens"
            )
        if not 0 <= first_token < self.model.config.vocab_size:
            raise ValueError(f"token id {first_token} is outside 0..{self.model.config.vocab_size - 1}")
        key = sampling_key(spec)
        if not continue_request:
            self.sampler.prepare(spec, history)
        wants_logprobs = spec.num_logprobs is not None
        self.token_in.fill_(first_token)
        self.position.fill_(start_pos)
        buckets = kv_buckets(kv.max_tokens, self.min_bucket_tokens)
        hook = self.step_hook
        if not self.use_cuda_graphs:
            for i in range(max_new_tokens):
                if hook is not None:
                    hook.before_step()
                self._step(kv, bucket_for(start_pos + i, buckets), key)
                if hook is not None:
                    hook.after_step()
                token = int(self.token_out.item())
                if wants_logprobs:
                    self.last_logprob = self.sampler.read_logprob(token)
                yield token
            return
        for i in range(max_new_tokens):
            if hook is not None:
                hook.before_step()  # before a capture too: that runs the step as well
            self._graph(kv, bucket_for(start_pos + i, buckets), key).replay()
            if hook is not None:
                hook.after_step()
            slot = i % 2
            self._pinned[slot : slot + 1].copy_(self.token_out, non_blocking=True)
            if wants_logprobs:
                self._pinned_logprobs[slot].copy_(self.sampler.logprob_row, non_blocking=True)
            self._events[slot].record()
            if i > 0:
                yield self._read(1 - slot, wants_logprobs)
        yield self._read((max_new_tokens - 1) % 2, wants_logprobs)

    def _read(self, slot: int, wants_logprobs: bool = False) -> int:
        self._events[slot].synchronize()
        token = int(self._pinned[slot])
        if wants_logprobs:
            self.last_logprob = self.sampler.read_logprob(token, self._pinned_logprobs[slot])
        return token

    def generate(
        self, kv: KVCache, prompt_ids: Sequence[int], spec: SamplingSpec, max_new_tokens: int,
        start_pos: int = 0,
    ) -> Iterator[int]:
        """Prefill prompt_ids at start_pos, then yield up to max_new_tokens tokens."""
        ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)
        logits = self.prefill(kv, ids, start_pos)
        first = self.sample_first(logits, spec, prompt_ids)
        yield first
        end_pos = start_pos + len(prompt_ids)
        yield from self.decode(kv, first, end_pos, max_new_tokens - 1, spec,
                               continue_request=True, history=prompt_ids)
