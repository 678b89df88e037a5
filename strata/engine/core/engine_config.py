"""What the engine process is told to load; torch-free so the host can build it cheaply."""

from __future__ import annotations

import re
from dataclasses import dataclass

EXPERT_CACHE_WORDS = ("auto", "off", "all")
_EXPERT_CACHE_SIZE = re.compile(r"\d+(?:\.\d+)?\s*(mib|gib)")


def parse_expert_cache(spec: str | int) -> str:
    """The one vocabulary of --expert-cache, for the settings and the engine alike: auto,
    off, all, a number of expert slots >= 1, or a size such as 8192MiB or 8GiB. Returns it
    normalized (lower case, no spaces around); ValueError otherwise."""
    text = str(spec).strip().lower()
    if text in EXPERT_CACHE_WORDS or (text.isdigit() and int(text) >= 1) \
            or _EXPERT_CACHE_SIZE.fullmatch(text):
        return text
    raise ValueError(
        f"expert_cache {spec!r} is not understood: use auto, off, all, a slot count or a size"
    )


# A partial expert cache's one-token misses: read in place over PCIe ("off"), computed on
# the CPU ("on"), or on the CPU once their CPU form is made, meanwhile over PCIe ("auto").
CPU_EXPERT_MISSES = ("off", "on", "auto")
DEFAULT_CPU_EXPERT_CACHE_BYTES = 4 << 30  # ~1250 Q4_K_M experts of Qwen3-30B-A3B


def check_cpu_expert_misses(mode: str) -> str:
    """mode if it is one of CPU_EXPERT_MISSES; ValueError in one line otherwise."""
    if mode not in CPU_EXPERT_MISSES:
        raise ValueError(f"cpu_expert_misses must be one of {', '.join(CPU_EXPERT_MISSES)}, "
                         f"not {mode!r}")
    return mode


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    device: str = "auto"  # auto | cpu | cuda
    context_tokens: int = 0  # 0: the model's own, capped at DEFAULT_MAX_CONTEXT_TOKENS
    # Cache slots and their snapshots (DESIGN §5).
    kv_budget_bytes: int = 0  # KV of resident slots; 0: every slot may stay resident
    snapshot_dir: str | None = None  # None: strata.paths.snapshot_dir()
    snapshot_ram_budget_bytes: int = 4 << 30
    snapshot_disk_budget_bytes: int = 16 << 30
    persist_sessions: bool = False  # snapshots survive a restart (named files, not temp files)
    snapshot_ttl_s: float = 0.0  # 0: snapshots never expire
    # MoE expert cache in VRAM: auto (fill free VRAM minus a reserve), all, off, or N slots.
    expert_cache: str = "auto"
    # A partial expert cache's misses in one-token decode (CPU_EXPERT_MISSES; off until a GPU
    # run measures it: docs/architecture.md), and the bytes their CPU forms may keep.
    cpu_expert_misses: str = "off"
    cpu_expert_cache_bytes: int = DEFAULT_CPU_EXPERT_CACHE_BYTES
    # A preset name or config.json path: build seeded random weights of that shape instead of
    # reading model_path (then only a label), for benchmarks of real-sized models.
    random_weights: str | None = None
    # Bytes every arena together may map (--vram-budget); 0: no cap beyond the GPU's own.
    vram_budget_bytes: int = 0
    # Continuous batching (DESIGN §5): KV cache slots (--slots), sequences decoding together
    # (--parallel; 0: one per slot), and the prompt tokens prefilled per step between decode
    # steps, so a long prompt delays running streams by at most one chunk.
    num_slots: int = 4
    parallel: int = 0
    prefill_chunk_tokens: int = 512
    # A prompt alone in the engine prefills this many tokens a step (0 or less than the chunk:
    # the chunk): llama.cpp's server batches 2048 prompt tokens a step likewise.
    prefill_solo_chunk_tokens: int = 2048
    # The same over a partial expert cache (a staging area): every chunk stages every MoE
    # layer's experts from the host again (memory/expert_staging.py), so one chunk up to this
    # length stages them once for the whole prompt (0 or less than the solo chunk: that).
    partial_cache_solo_chunk_tokens: int = 8192
    # The fast decode path on CUDA (DESIGN §8): fast_decode False decodes and prefills with
    # the plain torch path. The next four force one piece on or off (None: the engine decides):
    # CUDA graphs, torch.compile'd element-wise groups, the Triton decode attention, the Triton
    # projections and norms of one token. fast_prefill_graphs False prefills fresh prompts as
    # called, without graphs. Settings (STRATA_FAST* in the environment) set these.
    fast_decode: bool = True
    fast_cuda_graphs: bool | None = None
    fast_compile_pointwise: bool | None = None
    fast_fused_attention: bool | None = None
    fast_dense_kernels: bool | None = None
    fast_prefill_graphs: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_cache", parse_expert_cache(self.expert_cache))
        check_cpu_expert_misses(self.cpu_expert_misses)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, not {self.num_slots}")
        if not 0 <= self.parallel <= self.num_slots:
            raise ValueError(f"parallel must be 0..num_slots ({self.num_slots}), not {self.parallel}")
        if self.prefill_chunk_tokens < 16:
            raise ValueError(f"prefill_chunk_tokens must be >= 16, not {self.prefill_chunk_tokens}")
        for name in ("prefill_solo_chunk_tokens", "partial_cache_solo_chunk_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, not {self.context_tokens}")
        for name in ("kv_budget_bytes", "snapshot_ram_budget_bytes",
                     "snapshot_disk_budget_bytes", "snapshot_ttl_s", "vram_budget_bytes",
                     "cpu_expert_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")

    @property
    def num_parallel(self) -> int:
        """Sequences that decode together: parallel, or one per slot when it is 0."""
        return self.parallel or self.num_slots
