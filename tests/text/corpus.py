"""Deterministic, varied test strings for tokenizer comparisons (no randomness at import)."""

from __future__ import annotations

import random

_PIECES = [
    "Hello", "world", " the", "I'll", "DON'T", "we've", "she'd", "It's", "you're", "'S",
    "12345", "3.14159", "1,000,000", "0x1F", "2024-01-31", "Café", "naïve", "résumé", "ünïcödé",
    "東京", "日本語のテキスト", "中文", "한국어", "Здравствуйте", "مرحبا", "שלום", "हिन्दी", "ελληνικά",
    "🚀", "👍🏽", "👨‍👩‍👧", "🇯🇵", "—", "…", "«»", "½", "²", "ℝ", "\u00a0", "\u200b",
    "def f(x):\n    return x**2", "if (a && b) { c++; }", "<div class=\"x\">", "a_b-c.d/e\\f",
    "   ", "\n", "\n\n", "\t", " \t \n ", "\r\n", "!!!", "???", "...", "$$", "@#%", "~^|<>=+",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<im_start>", "<|im_start",
]


def varied_strings(count: int, seed: int = 1234) -> list[str]:
    """count strings, each a random join of pieces and separators; the same every run."""
    rng = random.Random(seed)
    strings = ["", " ", "a", "  leading", "trailing  ", "x\n\ny", "🚀" * 3]
    separators = ["", " ", "  ", "\n", "\t", ", "]
    while len(strings) < count:
        pieces = rng.choices(_PIECES, k=rng.randint(1, 8))
        text = ""
        for piece in pieces:
            text += rng.choice(separators) + piece
        strings.append(text)
    return strings
