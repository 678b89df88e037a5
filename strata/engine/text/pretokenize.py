"""Pre-tokenizer split regexes, keyed by llama.cpp's `tokenizer.ggml.pre` names.

A byte-level BPE vocabulary only round-trips the way it was trained when text is cut into
words by the same regex before merging. The GGUF stores just a name for that regex; the
patterns below are the ones the upstream Hugging Face tokenizers use (llama.cpp keeps the same
table in `llama-vocab.cpp`). Several regexes in a list are applied one after another, each
cutting the pieces of the previous one.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

# GPT-2's original word splitter.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3 (tiktoken cl100k style): case-insensitive contractions, numbers in runs of <= 3.
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2/2.5/3: like Llama 3 but every digit on its own.
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Mistral's tekken and OpenAI's o200k (Llama 4): case-aware word pieces.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTION
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTION + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's fallback for files converted before `tokenizer.ggml.pre` existed.
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

_SPLITS_BY_PRE: dict[str, list[str]] = {
    "default": _DEFAULT,
    **{name: [_GPT2] for name in ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion")},
    **{
        name: [_LLAMA3]
        for name in (
            "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
            "lfm2", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4",
        )
    },
    # StarCoder-derived vocabularies (SmolLM, SmolLM2) cut every digit apart first.
    **{
        name: [r"\p{N}", _GPT2]
        for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
    },
    **{
        name: [_QWEN2]
        for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "kormo")
    },
    "tekken": [_TEKKEN],
    **{name: [_GPT4O] for name in ("gpt-4o", "llama4", "minimax-m2")},
}

# Vocabularies whose upstream tokenizer.json sets BPE `ignore_merges`: a word that is itself
# a token is taken whole instead of being rebuilt from merges.
# Mistral's tekken is a tiktoken vocabulary (a piece that is a token is taken whole), and
# llama.cpp sets ignore_merges for it too.
IGNORE_MERGES_PRES = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "tekken")
)

SUPPORTED_PRES = tuple(sorted(_SPLITS_BY_PRE))


def split_regexes(pre: str) -> list[str] | None:
    """The regexes for a `tokenizer.ggml.pre` name, or None when Strata does not know it."""
    return _SPLITS_BY_PRE.get(pre)


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer | None:
    """Split by the named regexes, then map bytes to GPT-2's printable byte alphabet."""
    regexes = split_regexes(pre)
    if regexes is None:
        return None
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
