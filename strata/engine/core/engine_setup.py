"""What the engine picks at load: the device, the compute dtype, and the CUDA-graph decoder
(with its prefill tuning, stored or measured)."""

from __future__ import annotations

import logging

import psutil
import torch

from strata.engine.core.engine_config import EngineConfig
from strata.engine.core.engine_errors import EngineError
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.random_weights import parameter_bytes

log = logging.getLogger("strata.engine.core.engine")  # the engine's load log, as before


def pick_device(requested: str) -> torch.device:
    if requested == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if requested == "cuda":
        raise EngineError("device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return torch.device("cpu")


def compute_dtype(device: torch.device, config: ModelConfig) -> torch.dtype:
    """bf16 on GPUs (half the bytes per token read). On the CPU float32 (exact parity, and
    faster for a small model's decode), unless float32 weights would take more than half the
    RAM: then bf16, which halves them and multiplies large matrices faster on CPUs with bf16
    instructions (bench/diag_cpu_dtype.py, docs/benchmarks.md)."""
    if device.type == "cuda":
        return torch.bfloat16
    ram_bytes = psutil.virtual_memory().total
    if parameter_bytes(config, torch.float32) > ram_bytes // 2:
        log.info("float32 weights would take over half of the %.0f GiB of RAM: bf16 instead",
                 ram_bytes / (1 << 30))
        return torch.bfloat16
    return torch.float32


def max_prefill_tokens(config: EngineConfig) -> int:
    """The longest chunk any prefill of this engine runs: the scheduler's chunk sizes (a
    partial expert cache's solo chunk included: whether the cache is partial is decided
    after this bound sizes it), or the fast prefiller's own (its load-time tuning times one)."""
    from strata.engine.core.fast.prefill import DEFAULT_PREFILL_CHUNK_TOKENS

    return max(config.prefill_chunk_tokens, config.prefill_solo_chunk_tokens,
               config.partial_cache_solo_chunk_tokens, DEFAULT_PREFILL_CHUNK_TOKENS)


def solo_chunk_tokens(config: EngineConfig, stages_experts: bool) -> int:
    """Prompt tokens a step for a prompt alone in the engine: over a partial expert cache
    with a staging area (stages_experts) the larger of the two solo chunks, since each chunk
    stages every MoE layer's experts from the host again."""
    if stages_experts:
        return max(config.prefill_solo_chunk_tokens, config.partial_cache_solo_chunk_tokens)
    return config.prefill_solo_chunk_tokens


def fast_prefill_chunk_tokens(config: EngineConfig, stages_experts: bool) -> int:
    """The fast prefiller's chunk: its default, or a partial cache's solo chunk when longer,
    so that the scheduler's one chunk is not split again (and staged twice) below it."""
    from strata.engine.core.fast.prefill import DEFAULT_PREFILL_CHUNK_TOKENS

    return max(DEFAULT_PREFILL_CHUNK_TOKENS, solo_chunk_tokens(config, stages_experts))


def make_fast_decoder(model: torch.nn.Module, device: torch.device, config: EngineConfig,
                      step_hook=None, store=None, stages_experts: bool = False):
    """(the CUDA-graph decoder for a model on a GPU, where its prefill tuning came from:
    "stored" | "measured" | "none"); (None, "none") on the CPU or with fast_decode off.
    config's fast_* fields force pieces on or off; on the CPU, fast_compile_pointwise=True
    builds the decoder too (eagerly, no graphs: what CPU tests of the load's compile use).
    step_hook: a partial expert cache's promotion (ModelMemory.promotion), or None; store:
    where tuning results are kept (default: the kernel cache's, tuning_store.py);
    stages_experts: the model has a partial expert cache with a staging area (its prefill
    chunk is then fast_prefill_chunk_tokens).

    A load whose timings and kernel verdicts are stored leaves the compiling until it is
    ready (deferred_compile.py): the decoder's `has_deferred_work`."""
    is_forced_on_cpu = device.type == "cpu" and config.fast_compile_pointwise is True
    if (device.type != "cuda" and not is_forced_on_cpu) or not config.fast_decode:
        return None, "none"
    from strata.engine.core.fast_coverage import missing_features

    if missing := missing_features(model):
        log.info("fast decode and prefill: off, the reference forward runs (slower): the fast "
                 "path lacks %s", ", ".join(missing))
        return None, "none"
    from strata.engine.core.fast.decode_graph import GraphDecoder
    from strata.engine.core.fast.tuning_store import TuningStore

    store = store if store is not None else TuningStore()
    decoder = GraphDecoder(
        model,
        use_cuda_graphs=config.fast_cuda_graphs,
        compile_pointwise=config.fast_compile_pointwise,
        fused_attention=config.fast_fused_attention,
        dense_kernels=config.fast_dense_kernels,
        step_hook=step_hook,
        store=store,
        prefill_chunk_tokens=fast_prefill_chunk_tokens(config, stages_experts),
    )
    if decoder.note:
        log.info("fast decode: %s", decoder.note)
    tuned = decoder.tune_prefill(graphs=config.fast_prefill_graphs, store=store,
                                 defer_compile=True)
    if tuned["compile"] == "deferred":
        log.info("prefill groups compile after the load is ready; eager until then")
    if tuned["warm_up_s"]:
        log.info("prefill kernels compiled in %.1f s", tuned["warm_up_s"])
    timed = "an earlier load" if tuned["source"] == "stored" else "this load"
    if seconds := tuned["ops_s"]:
        log.info("prefill element-wise groups: %s (one chunk, timed by %s: compiled %.1f ms, "
                 "eager %.1f ms)", "compiled" if decoder.prefill_ops.is_compiled else "eager",
                 timed, seconds["compiled"] * 1e3, seconds["eager"] * 1e3)
    if graphs := tuned["graphs"]:
        log.info("prefill graphs for fresh prompts of up to %d tokens (timed by %s: a chunk "
                 "replayed in %.1f ms; a called prefill's host time %.1f ms)",
                 graphs["graph_tokens"], timed, graphs["chunk_replay_s"] * 1e3,
                 graphs["host_s"] * 1e3)
    return decoder, tuned["source"]
