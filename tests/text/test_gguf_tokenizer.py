"""The tokenizer rebuilt from GGUF metadata, against the real SmolLM2 file and oracles."""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from strata.engine.text import TextAssetsError, load_text_assets
from strata.engine.text.gguf_tokenizer import GGUFVocab, build_tokenizer
from strata.engine.text.pretokenize import SUPPORTED_PRES, byte_level_pre_tokenizer

from .corpus import varied_strings
from .spm_gguf import write_spm_gguf

MIXED = "Café naïve — 東京 🚀 ünïcödé"


def test_round_trip_exact(smollm2):
    ids = smollm2.encode(MIXED, add_special=False)
    assert smollm2.decode(ids) == MIXED
    assert all(smollm2.decode(smollm2.encode(s, add_special=False), skip_special=False) == s
               for s in varied_strings(200))


def test_metadata_and_bos_rule(smollm2):
    # SmolLM2's GGUF says add_bos_token = false, so plain encode adds nothing.
    assert smollm2.add_bos is False
    assert smollm2.bos_token_id == 1 and smollm2.bos_token == "<|im_start|>"
    assert smollm2.eos_token_ids[0] == 2 and smollm2.eos_token == "<|im_end|>"
    assert 0 in smollm2.eos_token_ids  # <|endoftext|> also ends a turn
    assert smollm2.vocab_size == 49152
    assert smollm2.encode("Hello", add_special=True) == smollm2.encode("Hello", add_special=False)
    assert {0, 1, 2} <= smollm2.special_token_ids


def test_control_tokens_are_whole_and_skippable(smollm2):
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>", add_special=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids) == "user\nhi"
    assert smollm2.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"


def test_smollm_splits_every_digit(smollm2):
    pieces = smollm2.tokenizer.encode("in 2024", add_special_tokens=False).tokens
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_matches_transformers_on_varied_strings(smollm2, smollm2_gguf, hf_offline):
    """Independent oracle: transformers' own GGUF conversion, with SmolLM2's HF pre-tokenizer
    (Digits then ByteLevel, from its tokenizer.json) where the GGUF only stores the name."""
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    oracle.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    strings = varied_strings(400)
    mismatches = [s for s in strings if smollm2.encode(s, add_special=False)
                  != oracle.encode(s, add_special_tokens=False)]
    assert mismatches == []


def test_every_known_pre_tokenizer_builds_and_splits():
    for pre in SUPPORTED_PRES:
        pieces = byte_level_pre_tokenizer(pre).pre_tokenize_str("Hello world, it's 2024!\n")
        assert "".join(p for p, _ in pieces) == "HelloĠworld,Ġit'sĠ2024!Ċ", pre


def _vocab(**changes) -> GGUFVocab:
    base = {"model": "gpt2", "pre": "gpt-2", "tokens": ["a", "b", "ab"],
            "token_types": [1, 1, 1], "scores": [], "merges": ["a b"], "bos_token_id": None,
            "eos_token_id": None, "eot_token_id": None, "eom_token_id": None,
            "unknown_token_id": None, "add_bos": False, "add_eos": False,
            "add_space_prefix": False, "chat_template": None}
    return GGUFVocab(**{**base, **changes})


def test_unknown_pre_and_model_are_clear_errors():
    assert build_tokenizer(_vocab()).encode("ab").ids == [2]
    with pytest.raises(TextAssetsError, match="unknown pre-tokenizer 'martian'"):
        build_tokenizer(_vocab(pre="martian"))
    with pytest.raises(TextAssetsError, match="tokenizer model 'bert'"):
        build_tokenizer(_vocab(model="bert"))


def test_not_a_model_path(tmp_path):
    with pytest.raises(TextAssetsError, match="does not exist"):
        load_text_assets(tmp_path / "missing.gguf")
    (tmp_path / "x.bin").write_bytes(b"nope")
    with pytest.raises(TextAssetsError, match="neither a GGUF"):
        load_text_assets(tmp_path / "x.bin")


# SentencePiece ("llama") vocabularies: a tiny file written with gguf's own writer.

SPM_STRINGS = ["hello world", "the thing in the world", "Hello World!", "at on an",
               "ünïcödé 東京 🚀", "a\nb", "trail ", "x", "", "two  spaces inside"]


def test_sentencepiece_matches_transformers(tmp_path, hf_offline):
    transformers = pytest.importorskip("transformers")
    path = write_spm_gguf(tmp_path / "spm.gguf")
    assets = load_text_assets(path)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_STRINGS:
        assert assets.encode(text) == oracle.encode(text), text
        assert assets.decode(assets.encode(text)) == text


def test_sentencepiece_follows_llama_cpp_where_transformers_differs(tmp_path):
    assets = load_text_assets(write_spm_gguf(tmp_path / "spm.gguf"))
    assert assets.add_bos and assets.encode("x")[0] == 1  # no flag: llama.cpp adds BOS
    # Leading spaces survive (transformers' Metaspace drops one), and llama.cpp puts a space
    # prefix after every special token.
    assert assets.decode(assets.encode("  lead")) == "  lead"
    pieces = assets.tokenizer.encode("<s>the", add_special_tokens=False).tokens
    assert pieces == ["<s>", "▁the"]
    no_bos = load_text_assets(write_spm_gguf(tmp_path / "nobos.gguf", add_bos=False))
    assert no_bos.encode("x") == [no_bos.tokenizer.token_to_id("▁"),
                                  no_bos.tokenizer.token_to_id("x")]


# Mistral's Tekken (Mistral Nemo, Small 3.x, Devstral): a byte-level BPE GGUF with pre "tekken".

def _write_tekken_gguf(path) -> object:
    """Control tokens, the 256 byte-level characters, a few merges, and "ĠParis": a word
    token no merge builds, as tiktoken vocabularies have (only ignore_merges reaches it)."""
    import gguf

    from strata.engine.text.token_bytes import _byte_level_decoder

    controls = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]"]
    by_byte = {b: char for char, b in _byte_level_decoder().items()}
    chars = [by_byte[b] for b in range(256)]
    merges = ["H e", "He l", "Hel l", "Hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d"]
    merged = ["He", "Hel", "Hell", "Hello", "Ġw", "Ġwo", "Ġwor", "Ġworl", "Ġworld"]
    tokens = controls + chars + merged + ["ĠParis"]
    types = [gguf.TokenType.CONTROL] * len(controls) + [gguf.TokenType.NORMAL] * (
        len(tokens) - len(controls))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("tekken")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tekken_vocabulary_round_trips_and_follows_llama_cpp(tmp_path):
    assets = load_text_assets(_write_tekken_gguf(tmp_path / "tekken.gguf"))
    vocab = assets.tokenizer
    # No add_bos key: llama.cpp adds BOS for tekken.
    assert assets.add_bos and assets.encode("Hello")[0] == 1
    # A piece that is itself a token is taken whole (ignore_merges), merges build the rest.
    pieces = vocab.encode("Hello world Paris", add_special_tokens=False).tokens
    assert pieces == ["Hello", "Ġworld", "ĠParis"]
    # Control tokens stay whole; text of any kind comes back exactly.
    ids = assets.encode("[INST]Hello[/INST][TOOL_CALLS]f[ARGS]{}")
    assert [vocab.id_to_token(i) for i in ids[:3]] == ["<s>", "[INST]", "Hello"]
    for text in [*varied_strings(100), MIXED, "CamelCase HTTPServer l'été 123456"]:
        ids = assets.encode(text)
        assert assets.decode(ids[1:]) == text
