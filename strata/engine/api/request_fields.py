"""Which request fields each route honours; any other field is a 400 naming it (DESIGN §6).

"Accepted and ignored is worse than refused": a client that sends a field and gets an answer
that ignored it has been lied to. Each set lists what the route really acts on (its parsers
refuse values they cannot honour, e.g. best_of other than 1), plus fields that only label a
request (`user`, `metadata`), whose output does not depend on them. Extend a set only together
with the code that honours the field; docs/api.md lists each one.
"""

from __future__ import annotations

from strata.engine.api.errors import bad_request

_SLOT = frozenset({"strata_cache_slot", "id_slot"})
_LABELS = frozenset({"model", "user", "metadata", "store"})
# LM Studio's per-request keep-alive of the requested model (model_routing.apply_ttl).
_TTL = frozenset({"ttl"})
_OPENAI_SAMPLING = _SLOT | _LABELS | _TTL | frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "stream_options", "n", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "repeat_penalty", "repeat_last_n", "logit_bias", "logprobs"})
# Structured output by constrained decoding (grammar.py, output_format.py).
_OUTPUT = frozenset({"response_format", "json_schema", "grammar"})

OPENAI_CHAT_FIELDS = _OPENAI_SAMPLING | _OUTPUT | frozenset({
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "chat_template_kwargs",
    "enable_thinking", "reasoning_effort", "verbose"})
OPENAI_COMPLETION_FIELDS = _OPENAI_SAMPLING | _OUTPUT | frozenset({
    "prompt", "echo", "suffix", "best_of"})
ANTHROPIC_MESSAGES_FIELDS = _SLOT | frozenset({
    "model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "metadata", "tools", "tool_choice", "thinking",
    "output_config", "output_format"})
ANTHROPIC_COUNT_TOKENS_FIELDS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
    "output_format"})
OPENAI_EMBEDDING_FIELDS = _TTL | frozenset({"model", "input", "encoding_format", "dimensions",
                                            "user"})
LLAMA_EMBEDDING_FIELDS = frozenset({"model", "content", "input", "embd_normalize"})
OLLAMA_EMBED_FIELDS = frozenset({"model", "input", "truncate", "options", "keep_alive",
                                 "dimensions"})
OLLAMA_EMBEDDINGS_FIELDS = frozenset({"model", "prompt", "options", "keep_alive"})

# Fields clients commonly send that Strata does not do, with what to do instead.
_HINTS = {
    "mirostat": "use temperature, top_k, top_p and min_p",
    "typical_p": "use top_p or min_p",
}


def refuse_unknown_fields(body: dict, allowed: frozenset[str], route: str) -> None:
    """400 naming the first field of body that `route` does not honour; null and false count
    as absent (clients send `store: false` and the like, which ask for nothing)."""
    for name, value in body.items():
        if name not in allowed and value is not None and value is not False:
            hint = _HINTS.get(name, "leave it out")
            raise bad_request(f"'{name}' is not supported by {route}; {hint}", param=name)
