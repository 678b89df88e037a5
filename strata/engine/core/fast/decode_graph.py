"""GraphDecoder: one model's prefill and batch-1 decode on the fast path, behind one object.

It picks the parts at construction and keeps the API the engine calls:

- static_step.py    the decode step over fixed device buffers (what a graph captures)
- decode_runner.py  how steps run: CUDA graphs replayed (GraphRunner) or called (EagerRunner)
- prefill_runner.py called prefill chunks, and graphs for short fresh prompts
- tuning.py         what a load checks and measures (kernels, compiled groups, prefill graphs)

On a GPU steps replay from graphs; without CUDA (or with graphs off) the same step runs
eagerly, which is what CPU tests check.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from strata.engine.core.fast import expert_graphs, kernel_checks, split_runner, tuning
from strata.engine.core.fast.compiled import compiled_ops
from strata.engine.core.fast.decode_runner import DecodeRunner, EagerRunner, GraphRunner
from strata.engine.core.fast.deferred_compile import DeferredWork
from strata.engine.core.fast.forward import moe_token
from strata.engine.core.fast.graph_sampler import GraphSampler, sampling_key
from strata.engine.core.fast.moe_grouped import (
    is_grouped_capable,
    select_moe_impl,
    slot_layout,
)
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fast.prefill import DEFAULT_PREFILL_CHUNK_TOKENS
from strata.engine.core.fast.prefill_graph import PrefillGraphs
from strata.engine.core.fast.prefill_runner import PrefillRunner
from strata.engine.core.fast.static_step import (
    DEFAULT_MIN_BUCKET_TOKENS,
    LOGITS_KEY,
    StaticStep,
    StepHook,
    bucket_for,
    kv_buckets,
)
from strata.engine.core.fast.tuning_store import TuningStore
from strata.engine.core.fast_coverage import missing_features
from strata.engine.core.kernels import pdl
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.models.switch import SparseMoE
from strata.engine.core.quant.experts import is_quantized_experts
from strata.engine.core.token_ids import ids_on
from strata.engine.protocol import SamplingSpec, TokenLogprob

# Re-exported: callers of the decoder import these from here.
__all__ = ["DEFAULT_MIN_BUCKET_TOKENS", "LOGITS_KEY", "GraphDecoder", "StepHook", "bucket_for",
           "kv_buckets"]

log = logging.getLogger(__name__)

# Each MoE layer's misses wait for the host (fast/moe_cpu_misses.py), which a whole-step graph
# cannot hold: steps are called, or replayed as split graphs (split_runner.py) where
# STRATA_CPU_MISS_GRAPHS=1 asks for them until a GPU run has checked them.
CPU_MISSES_NOTE = ("CPU-computed expert misses: decode steps called (cut at each MoE layer), "
                   "no CUDA graph")


def has_cpu_misses(moe_layers: list[SparseMoE]) -> bool:
    """Whether any MoE layer computes its one-token misses on the CPU."""
    return any(getattr(slot_layout(m), "cpu_misses", None) is not None for m in moe_layers)


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
        store: TuningStore | None = None,
    ):
        """step_hook: called around every decode step; used only by the grouped MoE paths
        (a partial expert cache's promotion; its loop path moves experts itself). store:
        where the decode kernels' verdicts are kept (kernel_checks.py); None: always check."""
        if gaps := missing_features(model):
            raise ValueError(f"the fast paths lack {', '.join(gaps)}: run the reference model")
        self.model = model
        self.device = next(model.parameters()).device
        is_cuda = self.device.type == "cuda"
        if use_cuda_graphs and not is_cuda:
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")
        use_graphs = is_cuda if use_cuda_graphs is None else use_cuda_graphs
        self.moe_impl = "loop"
        self.note = ""
        moe_layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if moe_layers:
            self.moe_impl = select_moe_impl(moe_impl, self.device)
            if not all(is_grouped_capable(m, self.moe_impl) for m in moe_layers):
                self.moe_impl = "loop"
                self._add_note("an expert cache the Triton kernels cannot read: MoE loop")
            if self.moe_impl == "loop" and use_graphs:
                # The loop asks the host which experts run: a sync, which a graph cannot hold.
                use_graphs = False
                self._add_note("MoE loop: no CUDA graph")
            if use_graphs and has_cpu_misses(moe_layers) and not split_runner.graphs_enabled():
                use_graphs = False
                self._add_note(CPU_MISSES_NOTE)
        self.step_hook = step_hook if self.moe_impl != "loop" else None
        ops = prefill_ops = EAGER_OPS
        if compile_pointwise if compile_pointwise is not None else is_cuda:
            ops = compiled_ops()
            prefill_ops = compiled_ops(dynamic=True)  # chunk lengths vary per prompt
        self._kernels_asked = {
            "fused_attention": fused_attention if fused_attention is not None else is_cuda,
            "dense_kernels": dense_kernels if dense_kernels is not None else is_cuda}
        ops, notes, self.kernel_check = kernel_checks.decode_kernels(
            model, self.device, ops, **self._kernels_asked, store=store)
        # Work left for after the load is ready (deferred_compile.py); a load that read the
        # kernels' verdicts checks them again there, which also loads them.
        self.deferred = DeferredWork()
        if self.kernel_check == "stored":
            self.deferred.add([("check decode kernels", partial(self._recheck_kernels, store))])
        self.compile = "none"  # the prefill groups: none | at_load | deferred
        for text in notes:
            self._add_note(text)
        self.min_bucket_tokens = min_bucket_tokens
        sampler = GraphSampler(model.config.vocab_size, self.device,
                               min(model.config.max_position_embeddings, 1 << 17))
        self.step = StaticStep(model, ops, self.moe_impl, sampler)
        # A prefill graph cannot hold the MoE loop, which asks the host which experts run,
        # nor a partial expert cache's staging, whose copies the host plans per chunk from
        # the residency of the moment (fast/moe_staged.py).
        self.prefiller = PrefillRunner(
            model, self.moe_impl, prefill_ops, prefill_chunk_tokens,
            is_capturable=not moe_layers or (
                self.moe_impl != "loop" and all(m.expert_weights is None for m in moe_layers)))
        if (use_graphs and expert_graphs.is_enabled() and self.prefiller.is_capturable
                and moe_layers
                and any(is_quantized_experts(m.experts.gate_proj) for m in moe_layers)):
            self.prefiller.enable_expert_graphs(max(m.top_k for m in moe_layers))
        self.last_logprob: TokenLogprob | None = None  # of the token last yielded, if asked
        # With CPU-computed misses the called step is the split one (one sync a MoE layer).
        self._eager_runner = (split_runner.SplitEagerRunner if has_cpu_misses(moe_layers)
                              else EagerRunner)(self.step, self.step_hook)
        self._graph_runner: GraphRunner | None = None
        self.runner: DecodeRunner = self._eager_runner
        self.use_cuda_graphs = use_graphs

    def set_step_hook(self, hook: StepHook | None) -> None:
        """Call `hook` around every decode step from now on (a benchmark's forced routing
        wraps the expert cache's promotion this way: models/forced_routing.py)."""
        self.step_hook = hook
        for runner in (self._eager_runner, self._graph_runner):
            if runner is not None:
                runner.hook = hook

    def expert_cache_problem(self, host_readable: bool) -> str:
        """Why this decoder cannot take MoE layers that read a partial expert cache from now
        on (a live shrink of an all-resident model: use_expert_cache), or "" when it can.
        host_readable: the GPU reads the store's host copy in place (the slot table's
        misses need it: SlotExperts.layout)."""
        if self.moe_impl == "loop":
            return ""  # the reference module asks the provider; no graphs hold it
        if self.moe_impl == "triton" and host_readable:
            return ""
        return (f"MoE decode by {self.moe_impl} cannot read a partial expert cache: that "
                "needs the Triton kernels and a pinned host copy the GPU reads in place")

    def use_expert_cache(self, hook: StepHook | None) -> None:
        """The MoE layers read a partial expert cache from now on (their SlotExperts): drop
        the decode graphs that baked in the resident stacks (the next step captures again,
        lazily per bucket), call the cache's promotion around each step, and stop capturing
        prefills (staging copies are planned on the host per chunk)."""
        moe_layers = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        if self.moe_impl != "loop" and not all(is_grouped_capable(m, self.moe_impl)
                                               for m in moe_layers):
            raise ValueError("a MoE layer's expert cache cannot be read by the decode kernels")
        if self.moe_impl != "loop":
            self.set_step_hook(hook)
        self.clear()
        if self._graph_runner is not None:
            # A running stream's next step needs a graph over the slot table: spread its
            # warm-up over real steps so no step waits for a whole capture (the live
            # shrink's pause; docs/benchmarks.md, run 38).
            self._graph_runner.spread_capture = True
        self.prefiller.use_expert_cache()
        if has_cpu_misses(moe_layers):  # the whole-step graphs cannot wait for the host
            had_graphs = self.use_cuda_graphs
            self._eager_runner = split_runner.SplitEagerRunner(self.step, self.step_hook)
            self._graph_runner = None
            self.runner = self._eager_runner
            if had_graphs and split_runner.graphs_enabled():
                self.use_cuda_graphs = True  # the split graphs can
            elif had_graphs:
                self._add_note(CPU_MISSES_NOTE)

    def warm_expert_cache(self, provider: Callable[[int], object]) -> int:
        """Compile the kernels that MoE layers reading a partial expert cache run, before a
        live shrink needs them (use_expert_cache): one token through one layer of each kind
        (its experts' types and shapes) with provider(layer) (a SlotExperts) in place of the
        wired experts for that call. Without it the first step after the switch waited for
        Triton to compile the slot-table variants: 2.9-9 s (docs/benchmarks.md, run 37).
        Returns the layers run. Not during a request (deferred work)."""
        seen: set[tuple] = set()
        layers = self.model.model.layers
        hidden = torch.zeros(1, self.model.config.hidden_size, device=self.device,
                             dtype=self.model.model.embed_tokens.weight.dtype)
        with torch.inference_mode():
            for i, layer in enumerate(layers):
                mlp = layer.mlp
                if not isinstance(mlp, SparseMoE) or mlp.expert_weights is not None:
                    continue
                kind = tuple((type(w).__name__, str(getattr(w, "qtype", w.dtype)),
                              tuple(w.shape))
                             for w in (mlp.experts.gate_proj, mlp.experts.up_proj,
                                       mlp.experts.down_proj))
                if kind in seen:
                    continue
                seen.add(kind)
                mlp.expert_weights = provider(i)
                try:
                    moe_token(layer, hidden, self.ops, self.moe_impl)
                finally:
                    mlp.expert_weights = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(seen)

    def _add_note(self, text: str) -> None:
        """Append to `note`, what the decoder runs differently from its defaults, and why."""
        self.note = f"{self.note}; {text}" if self.note else text

    # ---- the parts' settings, readable and settable here --------------------------------------

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay from CUDA graphs (else they are called)."""
        return self.runner is self._graph_runner

    @use_cuda_graphs.setter
    def use_cuda_graphs(self, value: bool) -> None:
        if not value:
            self.runner = self._eager_runner
            return
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {self.device}")
        if self._graph_runner is None:
            moe_layers = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
            runner = (split_runner.SplitGraphRunner if has_cpu_misses(moe_layers)
                      else GraphRunner)
            self._graph_runner = runner(self.step, self.step_hook)
        self.runner = self._graph_runner

    @property
    def ops(self) -> PointwiseOps:
        """The decode step's element-wise groups and kernel switches."""
        return self.step.ops

    @ops.setter
    def ops(self, value: PointwiseOps) -> None:
        self.step.ops = value

    @property
    def prefill_ops(self) -> PointwiseOps:
        """The element-wise groups of a called prefill (the load's choice)."""
        return self.prefiller.ops

    @prefill_ops.setter
    def prefill_ops(self, value: PointwiseOps) -> None:
        self.prefiller.ops = value

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.prefiller.chunk_tokens

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        """Fresh prompts replayed from graphs, or None (plan_prefill_graphs sets them)."""
        return self.prefiller.graphs

    @property
    def sampler(self) -> GraphSampler:
        return self.step.sampler

    # ---- load-time tuning (tuning.py) ---------------------------------------------------------

    def tune_prefill(self, graphs: bool = True, store: TuningStore | None = None,
                     defer_compile: bool = False) -> dict:
        """What a load does before the first request: compile (warm_up_prefill), keep the
        faster element-wise groups for called prefills (choose_prefill_ops), then turn on
        prefill graphs where they pay (plan_prefill_graphs; graphs=False: never). With a
        store the timings of an earlier load on this GPU and model are reused (tuning.py's
        tune_prefill), and with defer_compile too the compiling is left to
        run_deferred_step. Returns what each found, where it came from ("source") and when
        the groups compile ("compile")."""
        tuned = tuning.tune_prefill(self.prefiller, self.use_cuda_graphs and graphs, store,
                                    defer_compile=defer_compile)
        self.deferred.add(tuned.pop("deferred"))
        self.compile = tuned["compile"]
        return tuned

    @property
    def has_deferred_work(self) -> bool:
        """Whether the load left work for later (run_deferred_step)."""
        return self.deferred.has_steps

    def run_deferred_step(self) -> str:
        """Run the next step of the load's deferred work; its name. Not during a request."""
        return self.deferred.run_next()

    def _recheck_kernels(self, store: TuningStore | None) -> None:
        """Check the decode kernels whose verdicts the load read; one that fails now is
        turned off (its decode graphs dropped) and the new verdicts stored."""
        ops = self.ops
        use_pdl = bool(self._kernels_asked["dense_kernels"]) and pdl.is_supported(self.device)
        verdicts = kernel_checks.check(self.model, self.device, **self._kernels_asked,
                                       use_pdl=use_pdl)
        off: dict[str, bool] = {}
        if ops.fused_attention and verdicts.attention:
            off["fused_attention"] = False
            self._add_note("torch attention")
        if ops.dense_kernels and verdicts.dense:
            off.update(dense_kernels=False, pdl=False)
            self._add_note("torch projections")
        if not off:
            return
        log.warning("decode kernels failed their check after the load (%s): turned off",
                    "; ".join(v for v in (verdicts.attention, verdicts.dense) if v))
        self.clear()  # graphs captured with them
        self.ops = dataclasses.replace(ops, **off)
        if store is not None:
            key = kernel_checks.verdicts_key(self.model, self.device, **self._kernels_asked,
                                             use_pdl=use_pdl)
            store.write(key, verdicts.as_json())

    def warm_up_prefill(self, num_tokens: int = 23) -> float:
        """tuning.warm_up_prefill: compile the prefill groups now; the seconds spent."""
        return tuning.warm_up_prefill(self.prefiller, num_tokens)

    def choose_prefill_ops(self, repeats: int = 2) -> dict[str, float]:
        """tuning.choose_prefill_ops: keep the faster prefill groups; the seconds of each."""
        return tuning.choose_prefill_ops(self.prefiller, repeats)

    def plan_prefill_graphs(self, repeats: int = 2) -> dict[str, float]:
        """tuning.plan_prefill_graphs: turn prefill graphs on where they pay; what it timed."""
        return tuning.plan_prefill_graphs(self.prefiller, self.use_cuda_graphs, repeats)

    # ---- graphs ---------------------------------------------------------------------------------

    def enable_prefill_graphs(self, max_tokens: int) -> None:
        """Replay fresh prompts of up to max_tokens (at most a chunk) from graphs; 0: off."""
        if max_tokens and not self.use_cuda_graphs:
            raise ValueError("prefill graphs need CUDA graphs, which this decoder does not use")
        self.prefiller.enable_graphs(max_tokens)

    def drop_prefill_graphs(self) -> None:
        """Give the prefill graphs' memory pool back; the next fresh prompt captures again."""
        self.prefiller.drop_graphs()

    def clear(self) -> None:
        """Drop every captured decode graph (e.g. after the KV cache or the weights moved)."""
        if self._graph_runner is not None:
            self._graph_runner.clear()

    @torch.inference_mode()
    def prepare(self, kv: KVCache, start_pos: int, num_tokens: int, spec: SamplingSpec) -> None:
        """Capture, ahead of time, the graphs that decoding num_tokens from start_pos will use."""
        buckets = kv_buckets(kv.max_tokens, self.min_bucket_tokens)
        self.runner.prepare(kv, start_pos, num_tokens, sampling_key(spec), buckets)

    # ---- generation ---------------------------------------------------------------------------

    def prefill_reach(self, kv: KVCache, num_tokens: int, start_pos: int) -> int:
        """How many positions prefilling num_tokens at start_pos writes K/V into: a replayed
        prompt writes its whole bucket (map that much first)."""
        return self.prefiller.reach(kv, num_tokens, start_pos)

    def prefill(self, kv: KVCache, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits [V] float32 of the last of token_ids [T] placed at start_pos.. (K/V written).

        A fresh prompt that a prefill graph takes is replayed; K/V are then written up to
        `prefill_reach` positions."""
        return self.prefiller.run(kv, token_ids, start_pos)

    @torch.inference_mode()
    def sample_first(self, logits: torch.Tensor, spec: SamplingSpec,
                     history: Sequence[int] = ()) -> int:
        """Start a request: load its sampling state and draw the first token from logits [V].
        history: the prompt's token ids (the penalty window starts with them)."""
        sampler = self.step.sampler
        sampler.prepare(spec, history)
        token = int(sampler.sample(logits[None], sampling_key(spec)).item())
        self.last_logprob = (sampler.read_logprob(token)
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
        vocab_size = self.model.config.vocab_size
        if not 0 <= first_token < vocab_size:
            raise ValueError(f"token id {first_token} is outside 0..{vocab_size - 1}")
        key = sampling_key(spec)
        if not continue_request:
            self.step.sampler.prepare(spec, history)
        wants_logprobs = spec.num_logprobs is not None
        self.step.start(first_token, start_pos)
        buckets = kv_buckets(kv.max_tokens, self.min_bucket_tokens)
        for token, logprob in self.runner.tokens(kv, start_pos, max_new_tokens, key, buckets,
                                                 wants_logprobs):
            if wants_logprobs:
                self.last_logprob = logprob
            yield token

    def generate(
        self, kv: KVCache, prompt_ids: Sequence[int], spec: SamplingSpec, max_new_tokens: int,
        start_pos: int = 0,
    ) -> Iterator[int]:
        """Prefill prompt_ids at start_pos, then yield up to max_new_tokens tokens."""
        logits = self.prefill(kv, ids_on(prompt_ids, self.device), start_pos)
        first = self.sample_first(logits, spec, prompt_ids)
        yield first
        end_pos = start_pos + len(prompt_ids)
        yield from self.decode(kv, first, end_pos, max_new_tokens - 1, spec,
                               continue_request=True, history=prompt_ids)
