"""Request bodies of the OpenAI and Anthropic dialects, parsed into one native params object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.engine.api import validation as v
from strata.engine.api.errors import bad_request
from strata.engine.protocol import SamplingSpec

OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user",
                "assistant": "assistant"}
ANTHROPIC_ROLES = {"user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class GenerationParams:
    """What a generation request asks for, independent of the API dialect."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stops: tuple[str, ...]
    is_stream: bool
    include_usage: bool
    slot: int

    def sampling(self, max_tokens: int, eos_token_ids: tuple[int, ...]) -> SamplingSpec:
        """The engine's SamplingSpec, stopping on the model's end-of-sequence tokens."""
        return SamplingSpec(max_tokens=max_tokens, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            seed=self.seed, stop_token_ids=tuple(eos_token_ids))


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


def parse_messages(body: dict, roles: dict[str, str]) -> list[dict[str, str]]:
    """'messages' as [{'role', 'content'}] with roles mapped for the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content'",
                              param="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in roles:
            raise bad_request(f"{where} has unknown role {role!r}; use one of "
                              f"{', '.join(roles)}", param="messages")
        content = _text_of(message.get("content"), where, allow_null=(role == "assistant"))
        parsed.append({"role": roles[role], "content": content})
    return parsed


def _refuse_unsupported(body: dict) -> None:
    if body.get("logprobs") not in (None, False):
        raise bad_request("'logprobs' is not supported by Strata yet; leave it out",
                          param="logprobs")


def parse_openai(body: dict) -> GenerationParams:
    """Sampling and streaming fields of /v1/chat/completions and /v1/completions."""
    _refuse_unsupported(body)
    n = v.get_int(body, "n", 1)
    if n != 1:
        raise bad_request(f"'n' is {n}; Strata generates one choice per request, use n=1",
                          param="n")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    stream_options = v.get_object(body, "stream_options")
    return GenerationParams(
        max_tokens=v.get_int(body, name, None, minimum=1),
        temperature=v.get_temperature(body, maximum=2.0), top_p=v.get_top_p(body),
        top_k=v.get_top_k(body), min_p=v.get_min_p(body), seed=v.get_seed(body),
        stops=v.get_stop_strings(body, "stop"), is_stream=v.get_bool(body, "stream"),
        include_usage=v.get_bool(stream_options, "include_usage"), slot=v.get_cache_slot(body))


def parse_anthropic_system(body: dict) -> str | None:
    """Anthropic's top-level 'system': a string or a list of text blocks."""
    system = body.get("system")
    if system is None:
        return None
    return _text_of(system, "'system'")


def parse_anthropic(body: dict, *, needs_max_tokens: bool = True) -> GenerationParams:
    """Sampling and streaming fields of /v1/messages (Anthropic's temperature is 0..1)."""
    _refuse_unsupported(body)
    max_tokens = v.get_int(body, "max_tokens", None, minimum=1)
    if max_tokens is None and needs_max_tokens:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    return GenerationParams(
        max_tokens=max_tokens, temperature=v.get_temperature(body, maximum=1.0),
        top_p=v.get_top_p(body), top_k=v.get_top_k(body), min_p=0.0, seed=None,
        stops=v.get_stop_strings(body, "stop_sequences", max_count=64),
        is_stream=v.get_bool(body, "stream"), include_usage=True, slot=v.get_cache_slot(body))
