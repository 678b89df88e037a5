"""Reasoning split out of Qwen3 / DeepSeek-R1 outputs, whole and streamed at any split."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.text.reasoning import (
    Answer,
    Reasoning,
    ReasoningSplitter,
    prompt_opens_thinking,
    template_thinks,
)

TEMPLATES = Path(__file__).parent / "templates"

CASES = [  # (output, starts inside, reasoning, answer)
    ("<think>\nThe user says hi.\n</think>\n\nHello!", False, "The user says hi.", "Hello!"),
    ("<think>\n\n</think>\n\nHello!", False, "", "Hello!"),  # Qwen3 with thinking off
    ("Okay, 2+2.\n</think>\n\n4", True, "Okay, 2+2.", "4"),  # DeepSeek-R1: prompt opened it
    ("Just an answer.", False, "", "Just an answer."),
    ("<thin", False, "", "<thin"),
    ("<think>\ncut off by max_tokens", False, "cut off by max_tokens", ""),
    # GLM-4.5 after `<|assistant|>`: a newline, then its think block without inner newlines
    ("\n<think>The user says hi.</think>\nHello!", False, "The user says hi.", "Hello!"),
    ("\nHello!", False, "", "Hello!"),  # GLM with thinking off: the prompt closed the block
]


def _run(pieces: list[str], starts_inside: bool) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_inside=starts_inside)
    out = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    return ("".join(p.text for p in out if isinstance(p, Reasoning)),
            "".join(p.text for p in out if isinstance(p, Answer)))


@pytest.mark.parametrize(("output", "inside", "reasoning", "answer"), CASES)
def test_whole_and_per_character(output, inside, reasoning, answer) -> None:
    assert _run([output], inside) == (reasoning, answer)
    assert _run(list(output), inside) == (reasoning, answer)


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 80), max_size=6))
def test_any_split(case, cuts) -> None:
    output, inside, reasoning, answer = case
    points = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *points], [*points, len(output)])]
    assert _run(pieces, inside) == (reasoning, answer)


def test_thinking_templates_are_recognised() -> None:
    assert template_thinks((TEMPLATES / "qwen3.jinja").read_text())
    assert template_thinks((TEMPLATES / "deepseek-r1.jinja").read_text())
    assert not template_thinks((TEMPLATES / "qwen2.5-instruct.jinja").read_text())
    assert template_thinks((TEMPLATES / "glm-4.6.jinja").read_text())
    assert not prompt_opens_thinking("[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>")
    assert prompt_opens_thinking("<｜Assistant｜><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
