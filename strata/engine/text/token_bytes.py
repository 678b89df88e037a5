"""The raw bytes behind one token, for `/tokenize` with pieces.

Decoding one token of a byte-level vocabulary can give half a UTF-8 character (U+FFFD once
decoded); llama.cpp's server then answers the piece as a list of byte values, and so do we.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: each byte has one character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def token_bytes(assets: Any, token_id: int) -> bytes:
    """The bytes token_id stands for (its text's UTF-8 when it decodes to whole characters)."""
    surface = assets.tokenizer.id_to_token(token_id) or ""
    if match := _BYTE_TOKEN.match(surface):
        return bytes([int(match.group(1), 16)])
    if "\u2581" in surface:  # SentencePiece's space mark; decoding one token alone drops it
        return surface.replace("\u2581", " ").encode("utf-8")
    text = assets.decode([token_id], skip_special=False)
    if "\ufffd" not in text:
        return text.encode("utf-8")
    table = _byte_level_decoder()
    if surface and all(ch in table for ch in surface):
        return bytes(table[ch] for ch in surface)
    return text.encode("utf-8")  # nothing better known: the replacement character itself


def token_piece(assets: Any, token_id: int) -> str | list[int]:
    """llama.cpp's `piece`: the text when the bytes are valid UTF-8, else the byte values."""
    raw = token_bytes(assets, token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)
