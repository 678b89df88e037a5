"""Request fields that shape sampling beyond temperature: penalties, logit_bias, logprobs, n.

Parsed into native values here (400 on bad input); the engine's sampler (core/sampling.py,
core/penalties.py) applies them, so none of these is accepted and then ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.engine.api import validation as v
from strata.engine.api.errors import bad_request

MAX_CHOICES = 8  # n: choices are decoded one after another (they share the prefill)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the legacy completions API
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(frozen=True)
class Penalties:
    """Repetition penalties over the last `repeat_last_n` tokens (prompt and output)."""

    presence: float = 0.0
    frequency: float = 0.0
    repeat: float | None = None  # None: the server's default
    repeat_last_n: int | None = None  # None: the server's default; -1: the whole context


def parse_penalties(body: dict) -> Penalties:
    """presence_penalty and frequency_penalty (OpenAI, -2..2), a multiplicative repeat
    penalty (vLLM's repetition_penalty, or llama.cpp's repeat_penalty) and llama.cpp's
    repeat_last_n window."""
    repeat_name = "repeat_penalty" if body.get("repeat_penalty") is not None \
        else "repetition_penalty"
    repeat_last_n = v.get_int(body, "repeat_last_n", None, minimum=-1)
    return Penalties(
        presence=v.get_float(body, "presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
        frequency=v.get_float(body, "frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        repeat=_optional_float(body, repeat_name, minimum=0.0, maximum=10.0),
        repeat_last_n=repeat_last_n)


def _optional_float(body: dict, name: str, *, minimum: float, maximum: float) -> float | None:
    if body.get(name) is None:
        return None
    return v.get_float(body, name, 0.0, minimum=minimum, maximum=maximum, exclusive_minimum=True)


def parse_logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in -100..100}, added to the logits."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"'logit_bias' has {len(value)} entries; at most "
                          f"{MAX_LOGIT_BIAS_ENTRIES} are allowed", param="logit_bias")
    bias = []
    for key, amount in value.items():
        token_id = v.parse_id_string(key)
        if token_id is None:
            raise bad_request(f"'logit_bias' key {key[:20]!r} is not a token id",
                              param="logit_bias")
        if (isinstance(amount, bool) or not isinstance(amount, (int, float))
                or not math.isfinite(amount) or not -100 <= amount <= 100):
            raise bad_request(f"'logit_bias' value for token {key} must be a number in "
                              "-100..100", param="logit_bias")
        bias.append((token_id, float(amount)))
    return tuple(bias)


def check_token_ids(bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    """400 when logit_bias names a token outside the model's vocabulary."""
    for token_id, _ in bias:
        if token_id >= vocab_size:
            raise bad_request(f"'logit_bias' names token {token_id}, outside the vocabulary "
                              f"0..{vocab_size - 1}", param="logit_bias")


def parse_chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (bool) and top_logprobs (0..20): None when off, else the number of
    alternatives per token."""
    is_on = v.get_bool(body, "logprobs")
    top = v.get_int(body, "top_logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top and not is_on:  # 0 with logprobs off asks for nothing: consistent, not ignored
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if is_on else None


def parse_completion_logprobs(body: dict) -> int | None:
    """The legacy completions API's logprobs: an integer 0..5 of alternatives, or null."""
    return v.get_int(body, "logprobs", None, minimum=0, maximum=MAX_COMPLETION_LOGPROBS)


def parse_n(body: dict) -> int:
    """How many choices to generate for the prompt (1..MAX_CHOICES)."""
    return v.get_int(body, "n", 1, minimum=1, maximum=MAX_CHOICES)
