"""token_bytes: the exact bytes of one token, also when it holds part of a UTF-8 character."""

from __future__ import annotations

from pathlib import Path

import pytest

from strata.default_model import DefaultModelError, default_model_path
from strata.engine.text import load_text_assets
from strata.engine.text.token_bytes import token_bytes, token_piece

from .spm_gguf import write_spm_gguf

TEXT = "Héllo wörld 😀 ok"


def check_round_trip(assets) -> list[bytes]:
    ids = assets.encode(TEXT, add_special=False)
    pieces = [token_bytes(assets, i) for i in ids]
    assert b"".join(pieces).decode("utf-8").strip() == TEXT
    return pieces


def test_byte_level_bpe_tokens_give_their_exact_bytes() -> None:
    try:
        assets = load_text_assets(default_model_path(fetch=False))
    except DefaultModelError:
        pytest.skip("the default model is not downloaded")
    pieces = check_round_trip(assets)
    # The emoji is split across tokens: some piece is not valid UTF-8 on its own.
    partial = [p for p in pieces if p.decode("utf-8", errors="replace") != p.decode(
        "utf-8", errors="ignore")]
    assert partial, pieces


def test_sentencepiece_byte_tokens_and_spaces(tmp_path: Path) -> None:
    assets = load_text_assets(write_spm_gguf(tmp_path / "spm.gguf"))
    pieces = check_round_trip(assets)
    assert b"\xf0" in pieces  # the emoji falls back to <0xF0> <0x9F> ... byte tokens


def test_tokenize_pieces_are_text_or_byte_lists(smollm2) -> None:
    split = [token_piece(smollm2, i) for i in smollm2.encode("🚀", add_special=False)]
    # The rocket is 4 bytes over several tokens: the pieces are byte lists, not U+FFFD.
    assert any(isinstance(p, list) for p in split)
    assert bytes(b for p in split for b in (p if isinstance(p, list) else p.encode())) \
        == "🚀".encode()
    assert token_piece(smollm2, smollm2.encode(" Paris", add_special=False)[0]) == " Paris"
