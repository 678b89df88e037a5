"""IncrementalDetokenizer: whole characters only, same text as a full decode, small window."""

from __future__ import annotations

import random

from strata.engine.text import IncrementalDetokenizer

from .corpus import varied_strings

MIXED = "Café naïve — 東京 🚀 ünïcödé 👨‍👩‍👧 🇯🇵"


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    pieces, at = [], 0
    for size in chunk_sizes:
        pieces.append(detok.push(ids[at:at + size]))
        at += size
    pieces.append(detok.push(ids[at:]))
    pieces.append(detok.flush())
    return pieces


def test_token_by_token_never_yields_half_characters(smollm2):
    ids = smollm2.encode(MIXED, add_special=False)
    # The string really does split characters across tokens, or the test would prove nothing.
    assert any("\ufffd" in smollm2.decode(ids[:n]) for n in range(1, len(ids)))
    pieces = stream(IncrementalDetokenizer(smollm2), ids, [1] * len(ids))
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) == smollm2.decode(ids) == MIXED


def test_random_chunks_on_varied_text(smollm2):
    rng = random.Random(7)
    for text in varied_strings(150):
        ids = smollm2.encode(text, add_special=False)
        chunks = [rng.randint(0, 3) for _ in range(len(ids))]
        pieces = stream(IncrementalDetokenizer(smollm2, skip_special=False), ids, chunks)
        assert "".join(pieces) == smollm2.decode(ids, skip_special=False), text
        assert not any("\ufffd" in piece for piece in pieces)


def test_special_tokens_skipped_or_kept(smollm2):
    ids = smollm2.encode("<|im_start|>assistant\nOK<|im_end|>", add_special=False)
    assert "".join(stream(IncrementalDetokenizer(smollm2), ids, [1] * len(ids))) == "assistant\nOK"
    kept = stream(IncrementalDetokenizer(smollm2.tokenizer, skip_special=False), ids, [1] * 9)
    assert "".join(kept) == "<|im_start|>assistant\nOK<|im_end|>"


def test_prompt_context_is_not_emitted(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "hi"}])
    reply = smollm2.encode("Hello there 🚀", add_special=False)
    detok = IncrementalDetokenizer(smollm2, prompt_ids=prompt)
    assert "".join(stream(detok, reply, [1] * len(reply))) == "Hello there 🚀"


def test_window_stays_small_over_a_long_stream(smollm2):
    """O(new tokens) per push: the decoded window never grows with the output length."""
    ids = smollm2.encode(" ".join(varied_strings(300)), add_special=False)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(smollm2)
    largest_window = 0
    for token_id in ids:
        detok.push([token_id])
        largest_window = max(largest_window, len(detok._ids))  # the ids it decodes per step
    assert largest_window <= 8


def test_partial_character_at_end_is_flushed_as_a_full_decode_shows_it(smollm2):
    ids = smollm2.encode("🚀", add_special=False)
    detok = IncrementalDetokenizer(smollm2)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == smollm2.decode(ids[:-1])
    assert detok.flush() == ""
