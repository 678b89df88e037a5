"""Forced routing's test side (models/forced_routing.py): a random trace of expert ids, and a
step hook that records what each step's routers left for the expert cache."""

from __future__ import annotations

import numpy as np


def random_trace(num_steps: int, num_layers: int, num_experts: int, top_k: int,
                 seed: int) -> np.ndarray:
    """[num_steps, num_layers, top_k] int32: each row top_k distinct expert ids."""
    rng = np.random.default_rng(seed)
    return np.array([[rng.permutation(num_experts)[:top_k] for _ in range(num_layers)]
                     for _ in range(num_steps)], dtype=np.int32)


class StepRecorder:
    """The hook forced routing chains to: after each step it records the ids every layer's
    router left for the cache (store.step_ids), then hands the step on to `inner` (the
    promotion; None where there is none to feed)."""

    def __init__(self, store, inner=None) -> None:
        self.store, self.inner = store, inner
        self.routed: list[list[int]] = []

    def before_step(self) -> None:
        if self.inner is not None:
            self.inner.before_step()

    def after_step(self, num_rows: int = 1) -> None:
        self.routed.append(self.store.step_ids[:, 0].flatten().tolist())  # a test may sync
        if self.inner is not None:
            self.inner.after_step(num_rows)
