"""Fill-in-the-middle tokens of a model's vocabulary, found by their text as llama.cpp finds
them when a GGUF does not name them: Qwen2.5-Coder and StarCoder-style, CodeLlama, DeepSeek."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_PREFIX = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>",
           "<｜fim▁begin｜>")
_SUFFIX = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>",
           "<｜fim▁hole｜>")
_MIDDLE = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>",
           "<｜fim▁end｜>")
_FILE_SEP = ("<|file_sep|>", "<file_sep>")


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    file_sep: int | None  # separates extra files of context (input_extra); None: none


def _find(assets: Any, texts: tuple[str, ...]) -> int | None:
    return next((i for i in map(assets.tokenizer.token_to_id, texts) if i is not None), None)


def fim_tokens(assets: Any) -> FimTokens | None:
    """The model's FIM tokens, or None when its vocabulary lacks prefix, suffix or middle."""
    prefix, suffix, middle = (_find(assets, t) for t in (_PREFIX, _SUFFIX, _MIDDLE))
    if prefix is None or suffix is None or middle is None:
        return None
    return FimTokens(prefix, suffix, middle, _find(assets, _FILE_SEP))
