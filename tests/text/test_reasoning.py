"""Reasoning split out of Qwen3 / DeepSeek-R1 / GLM `<think>` and Magistral / Ministral 3
Reasoning `[THINK]` outputs, whole and streamed at any split."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.text.reasoning import (
    MISTRAL_THINK,
    THINK,
    Answer,
    Reasoning,
    ReasoningSplitter,
    ThinkTags,
    prompt_opens_thinking,
    template_thinks,
    think_tags,
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


# What Magistral / Ministral 3 Reasoning write after `[/INST]`: the block, then the answer
# right after it (their template's system prompt shows that shape); or a plain answer.
MISTRAL_CASES = [  # (output, reasoning, answer)
    ("[THINK]The user says hi.[/THINK]Hello!", "The user says hi.", "Hello!"),
    ("[THINK]Weather: call the tool.[/THINK][TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}",
     "Weather: call the tool.", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    ("Just an answer, [THINK] not opened first.", "",
     "Just an answer, [THINK] not opened first."),
    ("[THI", "", "[THI"),  # cut short of a tag: the text as written
    ("[THINK]cut off by max_tokens [/THI", "cut off by max_tokens [/THI", ""),
    ("[THINK]a <think> and </think> are text here[/THINK]ok", "a <think> and </think> are "
     "text here", "ok"),
]


def _run(pieces: list[str], starts_inside: bool, tags: ThinkTags = THINK) -> tuple[str, str]:
    splitter = ReasoningSplitter(starts_inside=starts_inside, tags=tags)
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


@pytest.mark.parametrize(("output", "reasoning", "answer"), MISTRAL_CASES)
def test_mistral_think_block_whole_and_per_character(output, reasoning, answer) -> None:
    assert _run([output], False, MISTRAL_THINK) == (reasoning, answer)
    assert _run(list(output), False, MISTRAL_THINK) == (reasoning, answer)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(MISTRAL_CASES), cuts=st.lists(st.integers(0, 120), max_size=8))
def test_mistral_think_block_at_any_split(case, cuts) -> None:
    """[THINK] and [/THINK] cut across stream chunks anywhere still split the same."""
    output, reasoning, answer = case
    points = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *points], [*points, len(output)])]
    assert _run(pieces, False, MISTRAL_THINK) == (reasoning, answer)


def test_mistral_reasoning_template_is_recognised_and_instruct_ones_are_not() -> None:
    """Ministral 3 Reasoning's real template writes [THINK] blocks; Mistral's instruct
    templates (whose vocabularies carry the same tokens) do not think."""
    source = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
    assert think_tags(source) == MISTRAL_THINK and template_thinks(source)
    for name in ("mistral-small-3.2-instruct-2506.jinja", "mistral-nemo-instruct-2407.jinja"):
        assert think_tags((TEMPLATES / name).read_text()) is None
    assert think_tags((TEMPLATES / "qwen3.jinja").read_text()) == THINK
    assert prompt_opens_thinking("[INST]Hi[/INST][THINK]", MISTRAL_THINK)
    assert not prompt_opens_thinking("[INST]Hi[/INST]", MISTRAL_THINK)
