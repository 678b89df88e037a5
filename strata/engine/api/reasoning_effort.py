"""Reasoning effort (low / medium / high) from each API's field, for templates that take it.

gpt-oss's template reads `reasoning_effort` and writes `Reasoning: <effort>` into its system
message. OpenAI chat sends `reasoning_effort`, Responses `reasoning.effort`, Ollama `think`
("low" | "medium" | "high", or true / false), Anthropic a thinking budget in tokens, mapped
here to an effort. A model whose template takes no effort answers a 400 naming the field
(chat_plan.render_chat), never an effort silently dropped.
"""

from __future__ import annotations

from typing import Any

from strata.engine.api.errors import bad_request

EFFORTS = ("low", "medium", "high")
TEMPLATE_VARIABLE = "reasoning_effort"
# Anthropic budgets to efforts: under 4096 tokens low, under 16384 medium, else high
# (gpt-oss writes roughly 1-2k, 4-8k and 10k+ reasoning tokens at the three levels).
_LOW_BELOW_TOKENS, _MEDIUM_BELOW_TOKENS = 4096, 16384


def _effort(value: Any, param: str) -> str:
    if value not in EFFORTS:
        raise bad_request(f"'{param}' must be 'low', 'medium' or 'high'", param=param)
    return str(value)


def openai_reasoning_effort(body: dict) -> str | None:
    """Chat completions' `reasoning_effort`; None when absent."""
    value = body.get("reasoning_effort")
    return None if value is None else _effort(value, "reasoning_effort")


def responses_reasoning_effort(body: dict) -> str | None:
    """Responses' `reasoning` object: `effort` honoured; a `summary` cannot be (the reasoning
    comes back whole, as reasoning items), so asking for one is a 400."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", param="reasoning")
    for key, value in reasoning.items():
        if key not in ("effort", "summary", "generate_summary") and value is not None:
            raise bad_request(f"'reasoning.{key}' is not supported; leave it out",
                              param="reasoning")
        if key != "effort" and value is not None:
            raise bad_request(f"'reasoning.{key}' is not supported: reasoning comes back "
                              "whole as reasoning items, not summarized; leave it out",
                              param="reasoning")
    value = reasoning.get("effort")
    return None if value is None else _effort(value, "reasoning.effort")


def ollama_think(body: dict) -> tuple[bool | None, str | None]:
    """Ollama's `think`: (thinking on/off, effort). true / false switch thinking, an effort
    level asks for thinking at that effort; None leaves the template's default."""
    think = body.get("think")
    if think is None or isinstance(think, bool):
        return think, None
    if think in EFFORTS:
        return None, str(think)
    raise bad_request("'think' must be true, false, 'low', 'medium' or 'high'", param="think")


def budget_effort(budget_tokens: int) -> str:
    """The effort an Anthropic thinking budget maps to (see the thresholds above)."""
    if budget_tokens < _LOW_BELOW_TOKENS:
        return "low"
    return "medium" if budget_tokens < _MEDIUM_BELOW_TOKENS else "high"
