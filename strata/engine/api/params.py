"""Request bodies of the OpenAI and Anthropic dialects, parsed into one native params object."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from strata.engine.api import validation as v
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.request_fields import (
    ANTHROPIC_COUNT_TOKENS_FIELDS,
    ANTHROPIC_MESSAGES_FIELDS,
    OPENAI_CHAT_FIELDS,
    OPENAI_COMPLETION_FIELDS,
    refuse_unknown_fields,
)
from strata.engine.api.sampling_params import (
    Penalties,
    check_token_ids,
    parse_chat_logprobs,
    parse_completion_logprobs,
    parse_logit_bias,
    parse_n,
    parse_penalties,
)
from strata.engine.protocol import SamplingSpec
from strata.engine.text.sampling_defaults import SamplingDefaults

NO_PENALTIES = Penalties()
LLAMA_CPP_DEFAULTS = SamplingDefaults()


@dataclass(frozen=True)
class GenerationParams:
    """What a generation request asks for, independent of the API dialect. Sampling fields
    left out (None) take the server's defaults (SamplingDefaults) in sampling()."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stops: tuple[str, ...]
    is_stream: bool
    include_usage: bool
    slot: int | None  # None: the engine picks (the longest cached prefix, else LRU)
    penalties: Penalties = NO_PENALTIES
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_logprobs: int | None = None  # None: no logprobs; k: the top k alternatives too
    n: int = 1  # choices of the one prompt
    slot_param: str = "strata_cache_slot"  # the field the slot came in, for its 400
    reuse_cache: bool = True  # False: no cached prefix is reused (llama.cpp's cache_prompt)
    ignore_eos: bool = False  # True: the end-of-sequence tokens are banned, not stops
    return_progress: bool = False  # True: the engine reports the prompt's evaluation
    post_sampling_probs: bool = False  # logprob records of the sampler's distribution

    def sampling(self, max_tokens: int, eos_token_ids: tuple[int, ...],
                 defaults: SamplingDefaults = LLAMA_CPP_DEFAULTS, vocab_size: int | None = None,
                 choice: int = 0) -> SamplingSpec:
        """The engine's SamplingSpec for choice `choice` (its seed offset by the index),
        stopping on the model's end-of-sequence tokens."""
        if vocab_size is not None:
            check_token_ids(self.logit_bias, vocab_size)
        penalties = self.penalties
        # llama.cpp's ignore_eos: an end-of-sequence token can never be sampled.
        banned = tuple((t, -math.inf) for t in eos_token_ids) if self.ignore_eos else ()

        def pick(value, default):
            return default if value is None else value

        seed = pick(self.seed, defaults.seed)

        return SamplingSpec(
            max_tokens=max_tokens, temperature=pick(self.temperature, defaults.temperature),
            top_p=pick(self.top_p, defaults.top_p), top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            seed=seed if seed is None or not choice else (seed + choice) % 2**64,
            stop_token_ids=() if self.ignore_eos else tuple(eos_token_ids),
            repeat_penalty=pick(penalties.repeat, defaults.repeat_penalty),
            presence_penalty=penalties.presence, frequency_penalty=penalties.frequency,
            penalty_last_n=pick(penalties.repeat_last_n, defaults.repeat_last_n),
            logit_bias=self.logit_bias + banned, num_logprobs=self.num_logprobs,
            reuse_cache=self.reuse_cache, return_progress=self.return_progress,
            post_sampling_probs=self.post_sampling_probs)


def _text_of(content: Any, where: str, *, allow_null: bool = False) -> str:
    """A message's content: a string or a list of text parts/blocks, joined."""
    if content is None and allow_null:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} content must be a string or a list of text parts",
                          param="messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where} has a content part of type {kind!r}; only 'text' parts "
                              "are supported", param="messages")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where} has a text part without a string 'text'",
                              param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _max_tokens_name(body: dict) -> str:
    return "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"


def _parse_openai_common(body: dict, num_logprobs: int | None) -> GenerationParams:
    if v.get_bool(body, "store"):
        raise bad_request("'store': true is not supported; Strata keeps no stored completions",
                          param="store")
    v.get_object(body, "metadata")  # a label: checked, never acted on
    stream_options = v.get_object(body, "stream_options")
    return GenerationParams(
        max_tokens=v.get_int(body, _max_tokens_name(body), None, minimum=1),
        temperature=v.get_temperature(body, maximum=2.0), top_p=v.get_top_p(body),
        top_k=v.get_top_k(body), min_p=v.get_min_p(body), seed=v.get_seed(body),
        stops=v.get_stop_strings(body, "stop"), is_stream=v.get_bool(body, "stream"),
        include_usage=v.get_bool(stream_options, "include_usage"), **v.get_cache_slot(body),
        penalties=parse_penalties(body), logit_bias=parse_logit_bias(body),
        num_logprobs=num_logprobs, n=parse_n(body))


def parse_openai(body: dict, route: str = "/v1/chat/completions") -> GenerationParams:
    """Sampling and streaming fields of /v1/chat/completions (route: the one named in the
    400s, /apply-template takes the same body); a field it does not honour is a 400 naming
    it."""
    refuse_unknown_fields(body, OPENAI_CHAT_FIELDS, route)
    return _parse_openai_common(body, parse_chat_logprobs(body))


def parse_openai_completion(body: dict) -> GenerationParams:
    """Sampling and streaming fields of /v1/completions (logprobs is an integer there)."""
    refuse_unknown_fields(body, OPENAI_COMPLETION_FIELDS, "/v1/completions")
    if v.get_int(body, "best_of", 1, minimum=1) != 1:
        raise bad_request("'best_of' above 1 is not supported; use 'n' for several choices",
                          param="best_of")
    return _parse_openai_common(body, parse_completion_logprobs(body))


def parse_anthropic_system(body: dict) -> str | None:
    """Anthropic's top-level 'system': a string or a list of text blocks."""
    system = body.get("system")
    if system is None:
        return None
    return _text_of(system, "'system'")


def parse_anthropic(body: dict, *, needs_max_tokens: bool = True) -> GenerationParams:
    """Sampling and streaming fields of /v1/messages (Anthropic's temperature is 0..1);
    needs_max_tokens=False is count_tokens, which takes only the prompt's fields."""
    if "thread" in body:
        # The SDK's tool_runner sends `thread` and resends the whole history without it on
        # exactly this error code (anthropic/lib/threads/_thread_state.py).
        raise ApiError(400, "'thread' (message threads) is not supported; send the whole "
                       "conversation in 'messages' without it", "thread_unsupported_request",
                       param="thread", details={"error_code": "thread_unsupported_request"})
    refuse_unknown_fields(body, ANTHROPIC_MESSAGES_FIELDS if needs_max_tokens
                          else ANTHROPIC_COUNT_TOKENS_FIELDS,
                          "/v1/messages" if needs_max_tokens else "/v1/messages/count_tokens")
    max_tokens = v.get_int(body, "max_tokens", None, minimum=1)
    if max_tokens is None and needs_max_tokens:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    return GenerationParams(
        max_tokens=max_tokens, temperature=v.get_temperature(body, maximum=1.0),
        top_p=v.get_top_p(body), top_k=v.get_top_k(body), min_p=None, seed=None,
        stops=v.get_stop_strings(body, "stop_sequences", max_count=64),
        is_stream=v.get_bool(body, "stream"), include_usage=True, **v.get_cache_slot(body))
