"""The bytes a pool member maps once loaded, and what it holds at each level, for the budget.

On a GPU a load maps what load_size.py says (weights as stored, the expert cache per its policy,
a workspace). On the CPU the engine computes in float32 (bf16 past half the RAM,
engine_setup.compute_dtype), so GGUF blocks are widened: the estimate follows. Once a model has been
loaded, what its engine reported (resident + released, every arena) replaces the estimate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from strata.engine.service.levels import State
from strata.engine.service.load_size import LOAD_WORKSPACE_BYTES, stored_size
from strata.engine.service.status_schema import ArenaBytes

_FLOAT32_BYTES = 4
_BF16_BYTES = 2
# A sleeping engine on a GPU still holds its CUDA context and cuBLAS workspace.
SLEEPING_GPU_BYTES = 512 * 1024 * 1024
# The first token of a slot maps one page each of K and V in every layer (DESIGN §5: pages of
# 2 MiB multiples); a model is no use without that.
KV_PAGE_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class MemberSize:
    """A model's bytes once fully loaded, and the part that its expert cache takes."""

    full_bytes: int
    expert_bytes: int = 0

    def held_bytes(self, state: State | str | None, *, is_gpu: bool) -> int:
        """What the model holds at `state` (None: no engine was ever started for it).

        A model coming up counts in full: room was made for it and it is about to take it.
        """
        if state is None:
            return 0
        state = State(state)
        if state is State.EXPERTS_RELEASED:
            return self.full_bytes - self.expert_bytes
        if state is State.SLEEPING:
            return min(self.full_bytes, SLEEPING_GPU_BYTES) if is_gpu else 0
        if state in (State.UNLOADED, State.FAILED, State.STARTING):
            return 0
        return self.full_bytes  # loaded, busy, session offloaded, loading, waking, waiting


def estimate_size(model_path: str, *, is_gpu: bool, expert_cache: Any = "auto",
                  parameter_count: int = 0) -> MemberSize:
    """What loading model_path will map (0 when it cannot be told from its headers)."""
    size = stored_size(model_path)
    kv_bytes = 2 * KV_PAGE_BYTES * _num_layers(model_path)
    if is_gpu:
        if size is None:
            return MemberSize(0)
        experts = size.expert_cache_bytes(str(expert_cache))
        return MemberSize(size.dense_bytes + experts + kv_bytes + LOAD_WORKSPACE_BYTES, experts)
    num_params = parameter_count or _parameter_count(model_path)
    if not num_params and size is not None:  # no count from the header: from the bytes
        num_params = (size.dense_bytes + size.expert_bytes) // _BF16_BYTES
    width = _FLOAT32_BYTES
    if num_params * _FLOAT32_BYTES > psutil.virtual_memory().total // 2:
        width = _BF16_BYTES  # engine_setup.compute_dtype's choice on the CPU
    return MemberSize(num_params * width + kv_bytes)


def _num_layers(model_path: str) -> int:
    """The model's layer count from its header (0 when it cannot be read)."""
    path = Path(model_path)
    try:
        if path.is_dir():
            return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
        from strata.engine.gguf_file import open_gguf  # numpy + gguf constants, no torch

        metadata = open_gguf(path).metadata
        return int(metadata.get(f"{metadata.get('general.architecture', '')}.block_count", 0))
    except Exception:  # noqa: BLE001 - unreadable: no KV counted; the engine's own report will
        return 0


def _parameter_count(model_path: str) -> int:
    from strata.engine.core.loader import inspect_model  # host-safe: reads headers only

    try:
        return int(inspect_model(Path(model_path)).parameter_count)
    except Exception:  # noqa: BLE001 - unreadable: the bytes stand in
        return 0


def observed_size(vram: Mapping[str, ArenaBytes]) -> MemberSize | None:
    """A loaded engine's own account (status()["vram"]): every arena's resident + released
    bytes; None when it reported nothing."""
    if not vram:
        return None
    total = sum(a["resident_bytes"] + a["released_bytes"] for a in vram.values())
    experts = vram.get("experts")
    expert_bytes = experts["resident_bytes"] + experts["released_bytes"] if experts else 0
    return MemberSize(total, expert_bytes) if total else None
