"""Which request fields each route honours; any other field is a 400 naming it.

"Accepted and ignored is worse than refused" (DESIGN §6): a client that sends `tools` or
`response_format` and gets prose back has been lied to. Each set below lists what the route
really acts on, plus fields that only label a request (`user`, `metadata`), whose output does
not depend on them. Extend a set only together with the code that honours the field.
"""

from __future__ import annotations

from strata.engine.api.errors import bad_request

_SLOT = {"strata_cache_slot", "id_slot"}
_OPENAI_SAMPLING = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "stream_options", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "repeat_penalty", "repeat_last_n", "logit_bias", "logprobs", "user", "metadata", "store",
    *_SLOT,
}
OPENAI_CHAT_FIELDS = frozenset({
    *_OPENAI_SAMPLING, "messages", "max_completion_tokens", "top_logprobs",
})
OPENAI_COMPLETION_FIELDS = frozenset({*_OPENAI_SAMPLING, "prompt", "echo", "suffix", "best_of"})
ANTHROPIC_MESSAGES_FIELDS = frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "metadata", *_SLOT,
})
ANTHROPIC_COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system"})

# Fields clients commonly send that Strata does not do yet, with what to do instead.
_HINTS = {
    "tools": "send the request without tools",
    "tool_choice": "send the request without tools",
    "functions": "send the request without functions",
    "function_call": "send the request without functions",
    "response_format": "ask for the format in the prompt instead",
    "thinking": "this model has no thinking mode here; leave it out",
    "mirostat": "use temperature, top_k, top_p and min_p",
    "typical_p": "use top_p or min_p",
}


def refuse_unknown_fields(body: dict, allowed: frozenset[str], route: str) -> None:
    """400 naming the first field of body that `route` does not honour."""
    for name in body:
        if name not in allowed:
            hint = _HINTS.get(name, "leave it out")
            raise bad_request(f"'{name}' is not supported by {route}; {hint}", param=name)
