"""What a load checks and measures before the first request, so requests pay for none of it.

- Decode kernels: kernel_checks.py (checked at a first load, the verdicts stored).
- Prefill (`warm_up_prefill`, `choose_prefill_ops`, `plan_prefill_graphs`): compile the
  element-wise groups now, keep them for called prefills only where they beat eager ones
  here, and replay fresh prompts from graphs up to the length where that beats calling them.
  Figures behind each choice: docs/benchmarks.md, "Decode and prefill speed".
- `tune_prefill` runs the three in order; given a TuningStore (tuning_store.py) it keeps the
  timings per GPU and model on disk, and a later load on the same GPU, software and model
  decides from them without timing anything again (issue 18 item 6); such a load may also
  leave the compiling to after it is ready (`defer_compile`, deferred_compile.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from strata.engine.core import load_phases
from strata.engine.core.fast import deferred_compile
from strata.engine.core.fast.pointwise import EAGER_OPS
from strata.engine.core.fast.prefill_graph import MIN_BUCKET_TOKENS, PrefillGraphs, graph_tokens
from strata.engine.core.fast.prefill_runner import PrefillRunner
from strata.engine.core.fast.prefill_warm import warm_cudnn_plan, warm_prefill_pass
from strata.engine.core.fast.tuning_store import (
    TuningKey,
    TuningStore,
    device_identity,
    model_identity,
)
from strata.engine.core.kv_cache import KVCache

log = logging.getLogger(__name__)

# Eager prefill groups replace compiled ones only when this much faster: the two timings are
# taken back to back on a GPU that other programs may be using.
EAGER_PREFILL_MARGIN = 0.05


def faster_prefill_ops(seconds: dict[str, float]) -> str:
    """"eager" when its chunk took at least EAGER_PREFILL_MARGIN less time than compiled's."""
    return "eager" if seconds["eager"] < seconds["compiled"] * (1 - EAGER_PREFILL_MARGIN) \
        else "compiled"


def warm_up_prefill(prefiller: PrefillRunner, num_tokens: int = 23) -> float:
    """Compile the prefill's element-wise groups now (one short prefill into a scratch cache),
    so the first request does not pay it; on CUDA also build cuDNN's plan for a full chunk's
    attention. Returns the seconds spent (0 when nothing is compiled).

    One pass covers every later prompt: the groups compile for any token count (and
    separately for the one-row last layer), and the MoE blocks of the later layers compile
    once the first layer has shown that grouped GEMMs run here. num_tokens is a prime so that
    it equals no model dimension: torch.compile assumes sizes that are equal when it compiles
    stay equal ("duck sizing"), and 16 tokens with head_dim 16 compiled a variant that no
    other length could use."""
    if not prefiller.ops.is_compiled:
        return 0.0
    started_s = time.perf_counter()
    warm_prefill_pass(prefiller, prefiller.ops, num_tokens)
    warm_cudnn_plan(prefiller)
    return time.perf_counter() - started_s


@torch.inference_mode()
def choose_prefill_ops(prefiller: PrefillRunner, repeats: int = 2) -> dict[str, float]:
    """Keep the compiled prefill groups only where they beat eager ones here.

    A compiled call costs more host time than an eager op, so for a small model the host
    decides and for a large one the fused kernels do (bench/diag_prefill_ops.py). One full
    chunk each way, best of `repeats` after a warm run; the MoE block stays compiled either
    way. Returns the seconds of each ({} when nothing is compiled) and leaves the prefiller's
    ops at the faster (`faster_prefill_ops`)."""
    if not prefiller.ops.is_compiled:
        return {}
    compiled = prefiller.ops
    eager = dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)
    kv, ids = _scratch_chunk(prefiller)
    seconds: dict[str, float] = {}
    for name, ops in (("compiled", compiled), ("eager", eager)):
        prefiller.ops = ops
        seconds[name] = _best_s(prefiller.device, partial(prefiller.called, kv, ids, 0),
                                repeats + 1)
    prefiller.ops = eager if faster_prefill_ops(seconds) == "eager" else compiled
    del kv
    prefiller.drop_graphs()  # the expert graphs the probe captured: the first prompts recapture
    if prefiller.device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's cache and activations go back
    return seconds


@torch.inference_mode()
def plan_prefill_graphs(prefiller: PrefillRunner, use_cuda_graphs: bool,
                        repeats: int = 2) -> dict[str, float]:
    """Measure where replaying a fresh prompt's prefill from a graph beats calling it, and
    turn prefill graphs on up to that length (prefill_graph.py).

    Times a full chunk replayed from a graph and a MIN_BUCKET_TOKENS prompt called (the
    host's time; its GPU work is small), best of `repeats` after a warm run, in a scratch
    cache whose graph and pool are dropped after. Returns both and the longest prompt that
    takes a graph (graph_tokens); {} where graphs are off or cannot run."""
    prefiller.graphs = None
    if not use_cuda_graphs or not prefiller.is_capturable:
        return {}
    kv, ids = _scratch_chunk(prefiller)
    chunk = ids.shape[0]
    probe = PrefillGraphs(prefiller.padded, prefiller.device, chunk)
    replay_s = _best_s(prefiller.device, partial(probe.run, kv, ids), repeats + 1)
    if not probe.max_tokens:  # the capture failed (logged): called prefills only
        return {}
    host_s = _best_s(prefiller.device,
                     partial(prefiller.called, kv, ids[:MIN_BUCKET_TOKENS], 0), repeats + 1)
    probe.clear()
    del kv
    torch.cuda.empty_cache()
    max_tokens = graph_tokens(host_s, replay_s, chunk)
    prefiller.enable_graphs(max_tokens)
    return {"chunk_replay_s": replay_s, "host_s": host_s, "graph_tokens": max_tokens}


def tune_prefill(prefiller: PrefillRunner, use_cuda_graphs: bool,
                 store: TuningStore | None = None, repeats: int = 2,
                 defer_compile: bool = False) -> dict:
    """What a load does for prefill before the first request: compile the groups
    (warm_up_prefill), then choose the element-wise groups (choose_prefill_ops) and plan the
    prefill graphs (plan_prefill_graphs, only where use_cuda_graphs).

    With a store, the timings come from the file kept for this GPU, software and model when
    there is a valid one (no timing run at all), and are written there when measured. With
    stored timings and defer_compile, nothing compiles either: the prefill runs the same ops
    eagerly until the returned "deferred" steps have compiled them (deferred_compile.py).
    Returns {"warm_up_s", "ops_s", "graphs", "source", "compile", "deferred"}: source is
    "stored", "measured", or "none" (nothing to tune: no compiled groups and no graphs);
    compile is "at_load", "deferred" or "none"; deferred: (name, step) pairs to run later."""
    compiled = prefiller.ops
    wants_graphs = use_cuda_graphs and prefiller.is_capturable
    if not compiled.is_compiled and not wants_graphs:
        prefiller.graphs = None
        return {"warm_up_s": 0.0, "ops_s": {}, "graphs": {}, "source": "none",
                "compile": "none", "deferred": []}
    key = tuning_key(prefiller, use_cuda_graphs) if store is not None else None
    stored = store.read(key) if store is not None else None
    at_load = "at_load" if compiled.is_compiled else "none"
    if (stored is not None and defer_compile and compiled.is_compiled
            and apply_stored(prefiller, use_cuda_graphs, stored)):
        steps = deferred_compile.defer_prefill_compile(prefiller, compiled)
        return {"warm_up_s": 0.0, "ops_s": stored["ops_s"], "graphs": stored["graphs"],
                "source": "stored", "compile": "deferred", "deferred": steps}
    with load_phases.phase("compile"):
        warm_up_s = warm_up_prefill(prefiller)
    if stored is not None and apply_stored(prefiller, use_cuda_graphs, stored):
        return {"warm_up_s": warm_up_s, "ops_s": stored["ops_s"], "graphs": stored["graphs"],
                "source": "stored", "compile": at_load, "deferred": []}
    with load_phases.phase("tune"):
        ops_s = choose_prefill_ops(prefiller, repeats)
    with load_phases.phase("capture_graphs"):
        graphs = plan_prefill_graphs(prefiller, use_cuda_graphs, repeats)
    if store is not None:
        store.write(key, {"ops_s": ops_s, "graphs": graphs})
    return {"warm_up_s": warm_up_s, "ops_s": ops_s, "graphs": graphs, "source": "measured",
            "compile": at_load, "deferred": []}


def tuning_key(prefiller: PrefillRunner, use_cuda_graphs: bool) -> TuningKey:
    """The key of this prefiller's timings: its device, its model's content, and the settings
    that change what choose_prefill_ops and plan_prefill_graphs measure."""
    settings = {"chunk_tokens": _chunk_len(prefiller), "moe_impl": prefiller.moe_impl,
                "is_compiled": prefiller.ops.is_compiled,
                "is_capturable": prefiller.is_capturable,
                "use_cuda_graphs": bool(use_cuda_graphs),
                "has_moe_block": prefiller.ops.moe_block is not None,
                # A called prefill replays the experts' graphs: other host and GPU times.
                "expert_graphs": prefiller.expert_graphs is not None}
    return TuningKey(device_identity(prefiller.device), model_identity(prefiller.model),
                     settings)


def apply_stored(prefiller: PrefillRunner, use_cuda_graphs: bool, stored: dict) -> bool:
    """Set the prefiller's ops and graphs from stored timings, decided as a measurement
    would (faster_prefill_ops, graph_tokens); False (nothing changed, logged) for timings
    of the wrong shape."""
    ops_s, graphs = stored.get("ops_s"), stored.get("graphs")
    problem = _stored_problem(ops_s, graphs, prefiller.ops.is_compiled,
                              use_cuda_graphs and prefiller.is_capturable)
    if problem:
        log.info("stored prefill timings ignored (%s); tuning again", problem)
        return False
    if ops_s:
        compiled = prefiller.ops
        eager = dataclasses.replace(EAGER_OPS, moe_block=compiled.moe_block)
        prefiller.ops = eager if faster_prefill_ops(ops_s) == "eager" else compiled
    prefiller.graphs = None
    if graphs:
        max_tokens = graph_tokens(graphs["host_s"], graphs["chunk_replay_s"],
                                  _chunk_len(prefiller))
        prefiller.enable_graphs(max_tokens)
        graphs["graph_tokens"] = max_tokens
    return True


def _stored_problem(ops_s, graphs, is_compiled: bool, wants_graphs: bool) -> str:
    """'' when stored timings have the shape a measurement here would give; else why not."""
    def is_seconds(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0

    if not isinstance(ops_s, dict) or not isinstance(graphs, dict):
        return "ops_s and graphs must be objects"
    if is_compiled != bool(ops_s):
        return "prefill op timings do not match whether the groups are compiled"
    if ops_s and not all(is_seconds(ops_s.get(name)) for name in ("compiled", "eager")):
        return "prefill op timings are not seconds"
    if graphs and (not wants_graphs or not all(
            is_seconds(graphs.get(name)) for name in ("chunk_replay_s", "host_s"))):
        return "prefill graph timings are not seconds or graphs are off"
    return ""


def _chunk_len(prefiller: PrefillRunner) -> int:
    """The probes' chunk: a full prefill chunk, or the whole context where that is shorter."""
    return min(prefiller.chunk_tokens, prefiller.model.config.max_position_embeddings)


def _scratch_chunk(prefiller: PrefillRunner) -> tuple[KVCache, torch.Tensor]:
    """A KV cache for one full chunk and a chunk of token ids, for timing probes."""
    config = prefiller.model.config
    dtype = next(prefiller.model.parameters()).dtype
    chunk = _chunk_len(prefiller)
    kv = KVCache.for_config(config, chunk, dtype, prefiller.device)
    return kv, torch.arange(chunk, device=prefiller.device) % config.vocab_size


def _best_s(device: torch.device, fn: Callable[[], object], runs: int) -> float:
    """Wall seconds of the fastest of `runs` calls of fn, each between device syncs."""
    best_s = float("inf")
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started_s = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_s = min(best_s, time.perf_counter() - started_s)
    return best_s
