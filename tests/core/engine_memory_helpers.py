"""Helpers for the engine memory and level tests: a MoE whose experts are big enough to see
in the process RSS (96 MiB), engines on a budgeted CPU backend, RSS readings."""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.protocol import SamplingSpec

MIB = 1 << 20
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0)
NUM_EXPERTS = 32
NUM_LAYERS = 2
# gate + up + down of one expert, float32: 3 * 128 * 1024 * 4 bytes = 1.5 MiB; 64 of them.
EXPERT_BYTES = 3 * 128 * 1024 * 4
ALL_EXPERTS_BYTES = NUM_LAYERS * NUM_EXPERTS * EXPERT_BYTES


def save_big_expert_moe(directory: Path, seed: int = 0) -> Path:
    """A seeded random Qwen3-MoE with 2 layers of 32 experts (96 MiB of experts in float32)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, moe_intermediate_size=1024,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512,
        # Wide weights keep greedy picks far from ties.
        initializer_range=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def make_engine(
    model_dir: Path, snapshot_dir: Path, backend: CpuMmapBackend | None = None, **options
) -> Engine:
    options.setdefault("device", "cpu")
    options.setdefault("context_tokens", 256)
    engine = Engine(
        EngineConfig(model_path=str(model_dir), snapshot_dir=str(snapshot_dir), **options),
        backend=backend or CpuMmapBackend(),
    )
    engine.load()
    return engine


def run(engine: Engine, prompt: list[int], slot: int = 0, spec: SamplingSpec = GREEDY) -> list[int]:
    return [t for ids in engine.generate(prompt, spec, slot=slot) for t in ids]


def pages_return_to_os() -> bool:
    """False under the Windows emulation, whose portable page fallback only zero-fills (real
    Windows gives pages back by VirtualFree: tests/memory/test_os_pages.py); RSS checks apply
    where it is True, the rest of each test everywhere."""
    from strata.engine.core.memory import os_pages

    return os_pages.reserve(os_pages.PAGE_SIZE_BYTES).releases_pages


def anonymous_rss_bytes() -> int:
    """Resident memory minus file-backed pages, so library pages do not blur the figure."""
    info = psutil.Process().memory_info()
    return info.rss - getattr(info, "shared", 0)


def data_ptrs(engine: Engine) -> dict[str, int]:
    """Every parameter's address and every resident slot's K/V addresses."""
    ptrs = {name: p.data_ptr() for name, p in engine.model.named_parameters() if not p.is_meta}
    for slot, cache in engine.slots.resident.items():
        for layer, (k, v) in enumerate(zip(cache.kv.k, cache.kv.v)):
            ptrs[f"kv{slot}.k{layer}"], ptrs[f"kv{slot}.v{layer}"] = k.data_ptr(), v.data_ptr()
    return ptrs


def arena(engine: Engine, name: str) -> dict:
    return engine.status()["arenas"][name]
