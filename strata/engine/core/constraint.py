"""Constrained decoding: an llguidance matcher that masks each step's logits to a grammar.

The host compiles a request's JSON schema, GBNF or tool-call format into an llguidance grammar
(api/grammar.py) and sends it in SamplingSpec.grammar; the engine builds the matcher here with
a tokenizer made from the model's own vocabulary, because only the engine sees token ids step
by step. Each step: compute the allowed-token bitmask on the host (llguidance, ~0.1 ms), mask
the logits, sample, then feed the token back to the matcher.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import llguidance
import torch

from strata.engine.core.engine_errors import EngineError

_BITS = 32


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str, vocab_size: int, stop_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    # Building the token trie takes ~0.2 s for a 50k vocabulary: once per model and stop set.
    from strata.engine.text import load_text_assets

    assets = load_text_assets(model_path)
    return llguidance.LLTokenizer(assets.tokenizer.to_str(), n_vocab=vocab_size,
                                  eos_token=list(stop_ids) or None)  # None: the vocab's own


class TokenConstraint:
    """One request's grammar state: the allowed tokens of the next step, and what was taken."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, device: torch.device):
        self._matcher = matcher
        self.vocab_size = vocab_size
        num_words = (vocab_size + _BITS - 1) // _BITS
        self.bitmask = torch.zeros(num_words, dtype=torch.int32,
                                   pin_memory=device.type == "cuda")  # [W] host
        index = torch.arange(vocab_size, device=device)
        self._word = index // _BITS  # [V]
        self._shift = (index % _BITS).to(torch.int32)  # [V]
        self._device_bitmask = torch.zeros(num_words, dtype=torch.int32, device=device)

    def fill_bitmask(self) -> None:
        """Compute the next step's allowed tokens into the host bitmask (1 bit per token)."""
        self._matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(),
                                              self.bitmask.numel() * self.bitmask.element_size())
        self._check()

    def allowed(self) -> torch.Tensor:
        """The host bitmask, copied to the device and unpacked: bool [V]."""
        self._device_bitmask.copy_(self.bitmask, non_blocking=True)
        return ((self._device_bitmask[self._word] >> self._shift) & 1).bool()  # [V]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] (or [1, V]) with every token the grammar forbids next set to -inf."""
        self.fill_bitmask()
        allowed = self.allowed()
        return logits.masked_fill(~allowed.view(logits.shape), float("-inf"))

    def consume(self, token: int) -> None:
        """Advance the grammar by the sampled token (always an allowed one)."""
        if not self._matcher.consume_token(token):
            raise EngineError(f"constrained decoding: token {token} was refused by the grammar "
                              f"({self._matcher.get_error()})")

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing more (not even an end token)."""
        return self._matcher.is_stopped()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise EngineError(f"constrained decoding failed: {self._matcher.get_error()}")


def build_constraint(grammar: str, model_path: str | None, vocab_size: int,
                     stop_ids: Sequence[int], device: torch.device) -> TokenConstraint:
    """A TokenConstraint for one request; EngineError (a 400) for a grammar that fails."""
    if not model_path:
        raise EngineError("constrained output needs the model's tokenizer, and a model with "
                          "random weights has none; send the request without a grammar")
    tokenizer = _tokenizer(model_path, vocab_size, tuple(sorted(set(stop_ids))))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise EngineError(f"the output grammar cannot be used: {matcher.get_error()}")
    return TokenConstraint(matcher, vocab_size, device)
