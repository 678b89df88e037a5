"""Prefetch of the next MoE layer's experts during one token's decode over a partial expert
cache whose misses the CPU computes (issue 54).

That decode already waits for each MoE layer's routing on the host (moe_cpu_misses.py).
There the host also holds the layer's input x, and the next MoE layer has not started yet
(its attention runs first), so the host can guess which experts that layer will route to
and copy the missing ones in meanwhile:

- `RouterGuess` (the default): the next MoE layer's router applied to this layer's x, on
  the CPU (a [E, H] product, a few us), best logits first. The residual stream changes
  little from one layer to the next, so its routes can be guessed early; how well is
  model-specific, so `status` reports the recall (routed experts that were guessed).
- The guessed experts without a slot get one (ExpertCache.take_for_prefetch: the pool's
  lowest counts evicted, never an expert this layer or the guess uses; no use is counted,
  so a wrong guess is the next victim) and are copied in on the side stream. The copies
  start behind the compute stream's work queued before this layer's hits (an event
  recorded at the split): the hits read only this layer's routed experts, never a victim.
- The copies join ExpertPromotion's queue, which publishes a slot once its copy landed and
  the cache still maps it there. The next MoE layer's split publishes first, so a guess
  that landed is a hit (its kernels read VRAM), one still in flight a miss as before (the
  CPU or the link): a wrong or late guess costs link time, never a wrong answer.

Off unless `CpuMisses.prefetch` > 0 (a benchmark's flag until a GPU run measures it).
A benchmark whose routing is forced (models/forced_routing.py) guesses from its trace
instead (`TraceGuess`), at a recall it chooses: the router's guess of a random model says
nothing about a trained one's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from strata.engine.core.memory.expert_store import ExpertStore

# (the next MoE layer, this layer's x on the host [H]) -> expert ids, likeliest first
Guess = Callable[[int, torch.Tensor], list[int]]


class RouterGuess:
    """The next MoE layer's top-k experts by its router on this layer's x, computed on the
    CPU from a float32 copy of the router (made on the layer's first guess): its bias
    (GPT-OSS) and selection bias (GLM-4.5) applied, GLM's expert groups not."""

    def __init__(self) -> None:
        self.moes: dict[int, Any] = {}  # layer -> its SparseMoE, noted by its first split
        # layer -> the router's weight, bias and selection bias, float32 on the CPU
        self._routers: dict[int, tuple[torch.Tensor, torch.Tensor | None,
                                       torch.Tensor | None]] = {}

    def note(self, layer: int, moe: Any) -> None:
        self.moes.setdefault(layer, moe)

    def __call__(self, layer: int, x: torch.Tensor) -> list[int]:
        moe = self.moes.get(layer)
        if moe is None:  # its first split has not come yet (the first token)
            return []
        if layer not in self._routers:
            self._routers[layer] = tuple(  # type: ignore[assignment]
                None if t is None else t.detach().float().cpu()
                for t in (moe.router.weight, moe.router.bias, moe.e_score_correction_bias))
        weight, bias, selection = self._routers[layer]
        logits = weight @ x.float()
        if bias is not None:
            logits = logits + bias
        if selection is not None:  # GLM-4.5 chooses by sigmoid score plus this bias
            logits = torch.sigmoid(logits) + selection
        return logits.topk(moe.top_k).indices.tolist()


class ExpertPrefetch:
    """A partial cache's prefetch for one-token decode: at a MoE layer's split, once the
    promotion has published the landed copies, `score` (the guess made for this layer
    against its routes); `start` once its hits are queued (guess the next layer's experts, at most
    `count` and at most its top-k by RouterGuess, and copy the missing ones in)."""

    def __init__(self, store: ExpertStore, count: int, guess: Guess | None = None):
        if count < 1:
            raise ValueError(f"expert prefetch needs at least one expert a layer, not {count}")
        self.store = store
        self.count = count
        # MoE layer -> the MoE layer after it
        self._next_layer = dict(itertools.pairwise(store.layer_ids))
        self.router_guess = RouterGuess()
        self.guess: Guess = guess if guess is not None else self.router_guess
        self._copied: dict[int, list[int]] = {}  # layer -> experts copied in for its split
        self._guessed: dict[int, set[int]] = {}  # layer -> experts guessed for its split
        self.num_routed = 0  # routed experts of splits that had a guess
        self.num_guessed_right = 0  # of those, guessed
        self.num_hits = 0  # routed, copied in by a prefetch and landed by the split
        self.num_late = 0  # routed, copied in by a prefetch, still in flight at the split
        self.num_unused = 0  # copied in by a prefetch, not routed

    def score(self, layer: int, expert_ids: list[int], table: torch.Tensor) -> None:
        """Count how the guess for layer did against the ids it routed, by the table row
        the split used."""
        guessed = self._guessed.pop(layer, None)
        copied = self._copied.pop(layer, [])
        if guessed is None:
            return
        routed = set(expert_ids)
        self.num_routed += len(routed)
        self.num_guessed_right += len(routed & guessed)
        for expert in copied:
            if expert not in routed:
                self.num_unused += 1
            elif int(table[expert]) >= 0:
                self.num_hits += 1
            else:
                self.num_late += 1

    def start(self, layer: int, moe: Any, x_host: torch.Tensor, read_ids: list[int],
              queued: torch.cuda.Event | None, promotion: Any) -> None:
        """Guess the next MoE layer's experts from layer's x and copy those without a slot
        in on the side stream behind `queued` (an event recorded before layer's hits were
        queued; None on the CPU, where copies are synchronous), evicting none of read_ids
        (layer's experts that those kernels read), through promotion's queue (which
        publishes each copy once landed: ExpertPromotion.land, called at the next split)."""
        self.router_guess.note(layer, moe)
        following = self._next_layer.get(layer)
        if following is None:
            return
        guess = list(dict.fromkeys(self.guess(following, x_host)))[: self.count]
        self._guessed[following] = set(guess)
        store = self.store
        keep = [(layer, e) for e in read_ids]
        taken = store.cache.take_for_prefetch(following, guess, keep)
        self._copied[following] = [expert for expert, _ in taken]
        if taken:
            promotion.start_copies([(following, expert, slot) for expert, slot in taken],
                                        after=queued)

    def status(self) -> dict:
        """The prefetch's counters, as plain values."""
        return {"expert_prefetch": self.count,
                "num_prefetched": self.store.cache.num_prefetched,
                "prefetch_recall": (self.num_guessed_right / self.num_routed
                                    if self.num_routed else None),
                "num_prefetch_hits": self.num_hits, "num_prefetch_late": self.num_late,
                "num_prefetch_unused": self.num_unused}
