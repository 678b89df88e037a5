"""The exact bytes of one token, for logprobs: a token may hold part of a UTF-8 character,
which decoding it alone turns into U+FFFD, so OpenAI reports `bytes` beside the text.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) stores bytes as printable characters
(GPT-2's bytes_to_unicode table); SentencePiece vocabularies spell raw bytes `<0xHH>` and
spaces `▁`. Anything else falls back to the token's decoded text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(assets: Any, token_id: int) -> bytes:
    """The bytes token_id stands for in the model's text."""
    tokenizer = assets.tokenizer
    piece = tokenizer.id_to_token(token_id) or ""
    if token_id in assets.special_token_ids:
        return piece.encode("utf-8")
    if "ByteLevel" in type(tokenizer.decoder).__name__ or "ByteLevel" in repr(tokenizer.decoder):
        table = _byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    match = _BYTE_TOKEN.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if "▁" in piece:
        return piece.replace("▁", " ").encode("utf-8")
    return assets.decode([token_id], skip_special=False).encode("utf-8")


def token_text(assets: Any, token_id: int) -> str:
    """The token as text: its bytes decoded, a partial character as U+FFFD."""
    return token_bytes(assets, token_id).decode("utf-8", errors="replace")


def token_piece(assets: Any, token_id: int) -> str | list[int]:
    """llama.cpp's /tokenize `piece`: the text when the bytes are valid UTF-8, else the byte
    values (half a character would otherwise read U+FFFD)."""
    raw = token_bytes(assets, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
