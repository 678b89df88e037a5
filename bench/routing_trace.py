"""Synthetic MoE routing traces for benchmarks: which k experts each token takes, per layer.

Random weights route (almost) the same experts every token, so a cache benchmark over them
measures a hit rate of 1.00. These traces are imposed instead (models/forced_routing.py):

- "zipf": per layer, expert popularity p(rank r) ~ 1 / r**s over the E experts, the ranks
  a random permutation per layer (popular experts differ by layer); temporal correlation:
  each of the previous token's k experts of that layer stays, independently, with
  probability p_reuse; the token's other slots are drawn from the Zipf popularity without
  replacement among the experts not kept. No expert twice in one token.
- "uniform": k distinct experts uniformly at random per token and layer: the worst case
  for a cache (no skew, no reuse beyond chance, k / E).

docs/benchmarks.md ("MoE under a VRAM budget") says where the parameters come from. A trace
is an int32 array [tokens, layers, k]; the same seed gives the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ROUTINGS = ("zipf", "uniform")


@dataclass(frozen=True)
class TraceSpec:
    """How a trace is drawn: routing kind, Zipf exponent s, reuse probability, seed."""

    routing: str = "zipf"
    zipf_s: float = 1.0
    p_reuse: float = 0.3
    seed: int = 0

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not "
                             f"{self.routing!r}")
        if self.zipf_s < 0 or not 0 <= self.p_reuse <= 1:
            raise ValueError(f"zipf_s must be >= 0 and p_reuse in 0..1, got {self.zipf_s}, "
                             f"{self.p_reuse}")


def zipf_popularity(num_experts: int, s: float) -> np.ndarray:
    """p(rank r) = r**-s / sum, ranks 1..E, float64 [E] (rank 1 first)."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -s
    return weights / weights.sum()


def layer_popularity(num_layers: int, num_experts: int, s: float,
                     rng: np.random.Generator) -> np.ndarray:
    """[layers, E] probabilities: the Zipf law's ranks given to experts by a random
    permutation per layer."""
    ranked = zipf_popularity(num_experts, s)
    out = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        out[layer, rng.permutation(num_experts)] = ranked
    return out


def _top_k_without_replacement(log_weights: np.ndarray, k: int,
                               rng: np.random.Generator) -> np.ndarray:
    """[L, k] distinct indices per row of log weights [L, n] (-inf: never), drawn one after
    another with probability proportional to the weights among those left (Gumbel top-k)."""
    keys = log_weights - np.log(-np.log(rng.random(log_weights.shape)))
    return np.argpartition(-keys, k - 1, axis=1)[:, :k]


def make_trace(spec: TraceSpec, num_tokens: int, num_layers: int, num_experts: int,
               top_k: int) -> np.ndarray:
    """int32 [num_tokens, num_layers, top_k]: spec's routing, k distinct experts per
    (token, layer).

    zipf, per token and layer: each of the previous token's k experts is kept with
    probability p_reuse (so Binomial(k, p_reuse) of them), the other slots are drawn from the
    layer's Zipf popularity without replacement among the experts not kept."""
    if not 0 < top_k <= num_experts or num_tokens < 0 or num_layers <= 0:
        raise ValueError(f"need 0 < top_k <= num_experts and layers > 0, got top_k={top_k}, "
                         f"experts={num_experts}, layers={num_layers}, tokens={num_tokens}")
    rng = np.random.default_rng(spec.seed)
    trace = np.empty((num_tokens, num_layers, top_k), dtype=np.int32)
    flat = np.zeros((num_layers, num_experts))
    if spec.routing == "uniform":
        for t in range(num_tokens):
            trace[t] = _top_k_without_replacement(flat, top_k, rng)
        return trace
    log_popularity = np.log(layer_popularity(num_layers, num_experts, spec.zipf_s, rng))
    layers = np.arange(num_layers)[:, None]
    for t in range(num_tokens):
        if t == 0:
            trace[t] = _top_k_without_replacement(log_popularity, top_k, rng)
            continue
        prev = trace[t - 1]  # [L, k]
        kept = rng.random((num_layers, top_k)) < spec.p_reuse  # [L, k]
        log_weights = log_popularity.copy()
        log_weights[np.broadcast_to(layers, prev.shape)[kept], prev[kept]] = -np.inf
        drawn = _top_k_without_replacement(log_weights, top_k, rng)  # [L, k]
        # Slot j keeps prev[j], or takes the next drawn expert: the i-th slot not kept
        # takes drawn[i].
        nth_new = np.cumsum(~kept, axis=1) - 1  # [L, k]
        trace[t] = np.where(kept, prev, drawn[layers, np.maximum(nth_new, 0)])
    return trace


def reuse_fraction(trace: np.ndarray) -> float:
    """Of every (token after the first, layer, slot), the fraction whose expert the previous
    token of that layer also took."""
    if trace.shape[0] < 2:
        return 0.0
    prev, cur = trace[:-1], trace[1:]
    return float((cur[..., :, None] == prev[..., None, :]).any(axis=-1).mean())


def expert_counts(trace: np.ndarray, num_experts: int) -> np.ndarray:
    """[layers, E] how many tokens took each expert."""
    num_layers = trace.shape[1]
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        counts[layer] = np.bincount(trace[:, layer].ravel(), minlength=num_experts)
    return counts
