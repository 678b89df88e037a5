"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's vocabulary metadata.

A GGUF has no tokenizer.json: it stores tokens, token types, merges (or scores) and the name of
the pre-tokenizer under llama.cpp's keys. Only that metadata is read; tensors are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from strata.engine.text.errors import TextAssetsError
from strata.engine.text.pretokenize import (
    IGNORE_MERGES_PRES,
    SUPPORTED_PRES,
    byte_level_pre_tokenizer,
)

# llama.cpp's token types (gguf.TokenType).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6,
)
_SPM_SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF's metadata, in plain Python values."""

    model: str  # tokenizer.ggml.model: gpt2 | llama | ...
    pre: str  # tokenizer.ggml.pre, "default" when absent
    tokens: list[str]
    token_types: list[int]
    scores: list[float]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    unknown_token_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def read_gguf_vocab(path: str | Path) -> GGUFVocab:
    """Read the tokenizer metadata of a GGUF file (never its tensors)."""
    # Imported here so HF-only users skip gguf; the file is the loader's cached one.
    from strata.engine.gguf_file import open_gguf
    from strata.engine.gguf_reader import GGUFFormatError
    from strata.errors import StrataError

    try:
        reader = open_gguf(path)
    except StrataError as exc:
        raise TextAssetsError(f"cannot read {path} as GGUF ({exc})") from None

    def value(key: str, default=None):
        try:  # string arrays are decoded here, on first read
            return reader.metadata.get(key, default)
        except GGUFFormatError as exc:
            raise TextAssetsError(f"cannot read {path} as GGUF ({exc})") from None

    model = value("tokenizer.ggml.model")
    tokens = value("tokenizer.ggml.tokens")
    if model is None or not tokens:
        raise TextAssetsError(
            f"{path} has no tokenizer metadata (tokenizer.ggml.model/tokens); "
            "re-convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    token_types = value("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    # llama.cpp adds BOS by default for SentencePiece and Llama-3-style vocabularies.
    pre = value("tokenizer.ggml.pre", "default")
    default_add_bos = model == "llama" or pre in IGNORE_MERGES_PRES
    return GGUFVocab(
        model=model,
        pre=pre,
        tokens=list(tokens),
        token_types=[int(t) for t in token_types],
        scores=[float(s) for s in value("tokenizer.ggml.scores") or ()],
        merges=list(value("tokenizer.ggml.merges") or ()),
        bos_token_id=value("tokenizer.ggml.bos_token_id"),
        eos_token_id=value("tokenizer.ggml.eos_token_id"),
        eot_token_id=value("tokenizer.ggml.eot_token_id"),
        eom_token_id=value("tokenizer.ggml.eom_token_id"),
        unknown_token_id=value("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(value("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(value("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(value("tokenizer.ggml.add_space_prefix", model == "llama")),
        chat_template=value("tokenizer.chat_template"),
    )


def build_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's for this vocabulary.

    BOS/EOS are added by the post-processor exactly when the file asks for them.
    """
    if vocab.model == "gpt2":
        tokenizer = _byte_level_bpe(vocab)
    elif vocab.model == "llama":
        tokenizer = _sentencepiece_bpe(vocab)
    else:
        raise TextAssetsError(
            f"tokenizer model {vocab.model!r} in this GGUF is not supported: Strata reads 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece); use the model's HF directory instead"
        )
    _add_special_tokens(tokenizer, vocab)
    bos_id = vocab.bos_token_id if vocab.add_bos else None
    eos_id = vocab.eos_token_id if vocab.add_eos else None
    set_special_post_processor(
        tokenizer,
        bos_token=vocab.tokens[bos_id] if bos_id is not None else None,
        eos_token=vocab.tokens[eos_id] if eos_id is not None else None,
    )
    return tokenizer


def _first_ids(tokens: list[str]) -> dict[str, int]:
    # Some vocabularies repeat a string (padding placeholders); the first id wins, as in llama.cpp.
    ids: dict[str, int] = {}
    for index, token in enumerate(tokens):
        ids.setdefault(token, index)
    return ids


def _byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    pre_tokenizer = byte_level_pre_tokenizer(vocab.pre)
    if pre_tokenizer is None:
        raise TextAssetsError(
            f"unknown pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre) in this GGUF: Strata knows "
            f"{', '.join(SUPPORTED_PRES)}; use the model's HF directory instead"
        )
    if not vocab.merges:
        raise TextAssetsError("this GGUF's byte-level vocabulary has no merges; re-convert it")
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    try:
        bpe = models.BPE(
            vocab=_first_ids(vocab.tokens), merges=merges,
            ignore_merges=vocab.pre in IGNORE_MERGES_PRES,
        )
    except Exception as exc:  # tokenizers raises plain Exception on bad merges
        raise TextAssetsError(
            f"this GGUF's BPE merges are inconsistent ({exc}); re-convert it"
        ) from exc
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    """SentencePiece BPE as a `tokenizers` BPE: merges ranked by the merged piece's score."""
    if len(vocab.scores) != len(vocab.tokens):
        raise TextAssetsError("this GGUF's SentencePiece vocabulary has no scores; re-convert it")
    ids = _first_ids(vocab.tokens)
    unk = vocab.tokens[vocab.unknown_token_id] if vocab.unknown_token_id is not None else None
    bpe = models.BPE(
        vocab=ids, merges=_merges_from_scores(vocab, ids), unk_token=unk,
        byte_fallback=True, fuse_unk=True,
    )
    tokenizer = Tokenizer(bpe)
    steps = [normalizers.Replace(" ", _SPM_SPACE)]
    decode_steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
        decode_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.decoder = decoders.Sequence(decode_steps)
    return tokenizer


def _merges_from_scores(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    # SentencePiece merges the adjacent pair whose joined piece has the highest score; ranking
    # every (left, right) split of every mergeable piece by that score gives the same order.
    mergeable = {
        token for token, kind in zip(vocab.tokens, vocab.token_types)
        if kind in (TOKEN_NORMAL, TOKEN_USER_DEFINED)
    }
    ranked: list[tuple[float, int, int, str, str]] = []
    for token in mergeable:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-vocab.scores[ids[token]], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(tokenizer: Tokenizer, vocab: GGUFVocab) -> None:
    # Control tokens (<|im_start|>) are matched whole and skipped by decode(skip_special);
    # user-defined ones (<think>) are matched whole but kept as text.
    control, user = [], []
    for token, kind in zip(vocab.tokens, vocab.token_types):
        if kind == TOKEN_CONTROL:
            control.append(AddedToken(token, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    for special_id in (vocab.bos_token_id, vocab.eos_token_id, vocab.eot_token_id):
        if special_id is not None and vocab.token_types[special_id] != TOKEN_CONTROL:
            control.append(AddedToken(vocab.tokens[special_id], special=True, normalized=False))
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)


def set_special_post_processor(
    tokenizer: Tokenizer, bos_token: str | None, eos_token: str | None
) -> None:
    """Make `encode(add_special_tokens=True)` add exactly this BOS/EOS (None: add nothing)."""
    if bos_token is None and eos_token is None:
        tokenizer.post_processor = None
        return
    bos, eos = bos_token, eos_token
    single = " ".join(p for p in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if p)
    pair = " ".join(p for p in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if p)
    specials = [(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
