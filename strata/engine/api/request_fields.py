"""The request fields each endpoint knows; any other field is a 400 naming it (DESIGN §6).

A field listed here is either honoured or refused by its own parser with a reason (e.g. 'n'
other than 1); a field not listed is never silently dropped. docs/api.md lists each one.
"""

from __future__ import annotations

from strata.engine.api.errors import bad_request

# Tags with no effect on the output in any implementation: accepted as metadata.
_METADATA = frozenset({"model", "user", "metadata"})
_SLOTS = frozenset({"strata_cache_slot", "id_slot"})
# Sampling fields (parsed in params.py; penalties, logprobs and n belong to the sampling work).
_OPENAI_SAMPLING = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "n_probs",
    "presence_penalty", "frequency_penalty", "repeat_penalty"})
_OUTPUT = frozenset({"response_format", "json_schema", "grammar"})

OPENAI_CHAT = _METADATA | _SLOTS | _OPENAI_SAMPLING | _OUTPUT | frozenset({
    "messages", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "chat_template_kwargs", "enable_thinking"})
OPENAI_COMPLETIONS = _METADATA | _SLOTS | _OPENAI_SAMPLING | _OUTPUT | frozenset({
    "prompt", "echo", "suffix"})
ANTHROPIC_MESSAGES = _METADATA | _SLOTS | frozenset({
    "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
    "stream", "tools", "tool_choice", "thinking", "output_config", "output_format"})
ANTHROPIC_COUNT_TOKENS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
    "output_format"})

_HINTS = {
    "reasoning_effort": "turn thinking on or off with enable_thinking or chat_template_kwargs",
    "logit_bias": "Strata does not bias logits",
    "best_of": "Strata generates one sequence per choice",
}


def refuse_unknown(body: dict, known: frozenset[str]) -> None:
    """400 for the first field of body that the endpoint does not know; null and false count as
    absent (clients send `store: false` and the like, which ask for nothing)."""
    for name, value in body.items():
        if name not in known and value is not None and value is not False:
            hint = _HINTS.get(name, "Strata does not support it")
            raise bad_request(f"'{name}' is not supported ({hint}); leave it out", param=name)
