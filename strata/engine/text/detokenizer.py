"""Streaming token ids to text without ever emitting half a character.

Byte-level BPE splits one multi-byte UTF-8 character over several tokens, and decoding a prefix
of them shows U+FFFD. Re-decoding the whole output on every step would be O(n^2), so, like HF
TGI and vLLM, only a short window of trailing tokens is decoded: the text of the
tokens emitted last step was already sent, the text of those plus the new ones, minus that, is
new. Decoding with the previous tokens in front keeps the context SentencePiece needs to place
leading spaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens seed the window, so the first output token decodes in context.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; each push costs O(new tokens) on average.

    `assets_or_tokenizer` is a TextAssets or a `tokenizers.Tokenizer`. `prompt_ids` (optional)
    gives the last prompt tokens as context; their own text is never emitted.
    """

    def __init__(self, assets_or_tokenizer: Any, skip_special: bool = True,
                 prompt_ids: Sequence[int] = ()):
        tokenizer = getattr(assets_or_tokenizer, "tokenizer", assets_or_tokenizer)
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"IncrementalDetokenizer needs TextAssets or tokenizers.Tokenizer, "
                f"got {type(assets_or_tokenizer).__name__}"
            )
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # Special tokens the model's output format is read by (Harmony's) stay in the text.
        shown = getattr(assets_or_tokenizer, "shown_special_ids", frozenset())
        self._hidden_ids: frozenset[int] = frozenset()
        if skip_special and shown:
            self._hidden_ids = assets_or_tokenizer.special_token_ids - shown
            self._skip_special = False
        # Only the window is kept: ids[:_read] were emitted already and serve as context,
        # ids[_read:] are not emitted yet. Older ids are dropped as text goes out.
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if self._hidden_ids:
            ids = [i for i in ids if i not in self._hidden_ids]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated token ids; return the text they complete (maybe "")."""
        if not ids:
            return ""
        self._ids.extend(ids)
        prefix_text = self._decode(self._ids[:self._read])
        full_text = self._decode(self._ids)
        # A trailing U+FFFD is an unfinished character: wait for the token with its last byte.
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        # The tokens emitted now become the next window's context; older ones are dropped.
        del self._ids[:self._read]
        self._read = len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back at the end of the stream (a dangling partial character shows
        as U+FFFD, as a full decode would show it)."""
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[:self._read])
        full_text = self._decode(self._ids)
        del self._ids[:self._read]
        self._read = len(self._ids)
        return full_text[len(prefix_text):]
