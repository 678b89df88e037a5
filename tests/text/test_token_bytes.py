"""Token pieces as bytes: what /tokenize with_pieces answers for half a character."""

from __future__ import annotations

from strata.engine.text import load_text_assets
from strata.engine.text.token_bytes import token_bytes, token_piece
from tests.text.spm_gguf import write_spm_gguf

TEXTS = ["plain words", "ünïcödé 東京 🚀", "emoji 🙂🙂 and 😀"]


def test_byte_level_pieces_join_to_the_text(smollm2):
    for text in TEXTS:
        ids = smollm2.encode(text, add_special=False)
        assert b"".join(token_bytes(smollm2, i) for i in ids) == text.encode("utf-8")
    split = [token_piece(smollm2, i) for i in smollm2.encode("🚀", add_special=False)]
    # The rocket is 4 bytes over several tokens: the pieces are byte lists, not U+FFFD.
    assert any(isinstance(p, list) for p in split)
    assert bytes(b for p in split for b in (p if isinstance(p, list) else p.encode())) \
        == "🚀".encode()


def test_sentencepiece_byte_fallback_pieces(tmp_path):
    assets = load_text_assets(write_spm_gguf(tmp_path / "spm.gguf"))
    ids = assets.encode("東京 🚀", add_special=False)
    joined = b"".join(token_bytes(assets, i) for i in ids)
    assert joined.decode("utf-8") == " 東京 🚀"  # llama.cpp's space prefix included
