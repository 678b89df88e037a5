"""Logprob records (protocol.TokenLogprob) in OpenAI's shapes, and usage summed over n choices.

Chat: `logprobs.content` is a list of {token, logprob, bytes, top_logprobs}; the legacy
completions API: parallel lists tokens / token_logprobs / top_logprobs / text_offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from strata.engine.protocol import TokenLogprob, Usage
from strata.engine.text.token_bytes import token_bytes


def _entry(assets: Any, token_id: int, logprob: float) -> dict[str, Any]:
    raw = token_bytes(assets, token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
            "bytes": list(raw)}


def chat_logprobs(assets: Any, records: Sequence[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's (or chunk's) `logprobs` object."""
    content = []
    for record in records:
        entry = _entry(assets, record.token_id, record.logprob)
        entry["top_logprobs"] = [_entry(assets, i, lp) for i, lp in record.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(assets: Any, records: Sequence[TokenLogprob],
                        text_offset: int = 0) -> dict[str, Any]:
    """A text completion choice's `logprobs` object; text_offset: where its text starts."""
    tokens, offsets, tops = [], [], []
    for record in records:
        text = token_bytes(assets, record.token_id).decode("utf-8", errors="replace")
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top: dict[str, float] = {}
        for token_id, logprob in record.top:
            top.setdefault(token_bytes(assets, token_id).decode("utf-8", errors="replace"),
                           logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": tops, "text_offset": offsets}


def summed_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of n choices of one prompt: the prompt counted once (with the first choice's
    cache reads), completion tokens summed."""
    first = usages[0]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in usages),
                 first.cached_tokens, first.finish_reason)
