"""A tiny SentencePiece-style GGUF vocabulary written with gguf's writer (no tensors needed)."""

from __future__ import annotations

from pathlib import Path

import gguf

MERGED_PIECES = [
    "▁t", "he", "▁the", "in", "▁in", "ng", "ing", "▁a", "an", "▁an", "er", "▁h", "ll", "llo",
    "▁hello", "lo", "el", "▁w", "or", "▁wor", "ld", "▁world", "▁▁", "▁▁▁▁", "on", "▁on", "at",
]
SINGLE_CHARS = list("▁abcdefghijklmnopqrstuvwxyzTHW.,!'")


def write_spm_gguf(path: Path, add_bos: bool | None = None, arch: str = "llama") -> Path:
    """<unk>, <s>, </s>, 256 byte tokens, then merged pieces (best score first) and characters.

    arch: general.architecture (an unknown one makes a file the tokenizer reads and the
    engine refuses)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(MERGED_PIECES):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(rank))
    for rank, char in enumerate(SINGLE_CHARS):  # single characters score lowest, as in Llama
        tokens.append(char)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-1000.0 - rank)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_feed_forward_length(8)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
