"""The CPU forms of the experts a partial expert cache computes on the CPU (issue 54), made
from the store's host copy on first use and kept in a byte-bounded LRU.

A conversion costs 19-43 ms an expert of Qwen3-30B-A3B (docs/benchmarks.md, "What a
CPU-computed miss could run on"): many times the miss it saves, so the forms are kept and
every conversion is counted. Float experts need no conversion (a view of the host copy).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from strata.engine.core.memory.expert_layout import as_blocks
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.quant.cpu_experts import (
    CpuExpert,
    Projection,
    compute_dtype,
    cpu_expert,
    has_cpu_form,
)


def cpu_form_problem(store: ExpertStore) -> str:
    """Why the store's experts cannot be computed on the CPU here, or "" when they can."""
    for layer in store.layer_ids:
        for fmt in store.formats.get(layer, ()):
            if not has_cpu_form(fmt.qtype):
                return (f"layer {layer}'s experts are {fmt.qtype.name}, which has no CPU form "
                        "(gguf-py cannot dequantize it): set cpu_expert_misses to off")
    return ""


class CpuExpertCache:
    """(layer, expert) -> CpuExpert, least recently used dropped past limit_bytes (the
    expert being asked for is kept even when it alone is larger). Thread-safe: a worker
    converting one expert does not hold up another reading a kept one."""

    def __init__(self, store: ExpertStore, limit_bytes: int, model_dtype: torch.dtype):
        if limit_bytes < 0:
            raise ValueError(f"the CPU expert cache's limit must be >= 0 bytes, not {limit_bytes}")
        if problem := cpu_form_problem(store):
            raise ValueError(problem)
        self.store = store
        self.limit_bytes = limit_bytes
        self.dtype = compute_dtype(model_dtype)
        self._experts: OrderedDict[tuple[int, int], CpuExpert] = OrderedDict()
        self.nbytes = 0
        self.num_conversions = 0
        self.num_evictions = 0
        self.convert_s = 0.0
        self._lock = threading.Lock()  # the LRU and its counters; never held to convert

    def __len__(self) -> int:
        return len(self._experts)

    def __contains__(self, key: tuple[int, int]) -> bool:
        with self._lock:
            return key in self._experts

    def projections(self, layer: int, expert: int) -> tuple[Projection, ...]:
        """The host copy of one expert's gate, up and down as Projections."""
        host = self.store.host_expert(layer, expert)
        if not self.store.is_quantized:
            return tuple(Projection(w, None, w.shape[0], w.shape[1]) for w in host)
        return tuple(Projection(as_blocks(w[None], fmt)[0], fmt.qtype, *fmt.shape)
                     for w, fmt in zip(host, self.store.formats[layer]))

    def expert(self, layer: int, expert: int) -> CpuExpert:
        """The CPU form of one expert, converted now if not kept."""
        key = (layer, expert)
        with self._lock:
            found = self._experts.get(key)
            if found is not None:
                self._experts.move_to_end(key)
                return found
        started_s = time.perf_counter()
        converted = cpu_expert(*self.projections(layer, expert), self.dtype)
        seconds = time.perf_counter() - started_s
        with self._lock:
            self.convert_s += seconds
            self.num_conversions += 1
            found = self._experts.get(key)  # another thread's, converted meanwhile
            if found is not None:
                return found
            self._experts[key] = converted
            self.nbytes += converted.nbytes
            while self.nbytes > self.limit_bytes and len(self._experts) > 1:
                _, dropped = self._experts.popitem(last=False)
                self.nbytes -= dropped.nbytes
                self.num_evictions += 1
        return converted

    def clear(self) -> None:
        """Drop every kept form (the host copy stays)."""
        with self._lock:
            self._experts.clear()
            self.nbytes = 0

    def status(self) -> dict[str, Any]:
        """Kept forms, their bytes and the conversions so far, as plain values."""
        return {"cpu_cache_bytes": self.nbytes, "cpu_cache_limit_bytes": self.limit_bytes,
                "cpu_cached_experts": len(self._experts),
                "num_cpu_conversions": self.num_conversions,
                "num_cpu_cache_evictions": self.num_evictions,
                "cpu_convert_s": round(self.convert_s, 6)}
