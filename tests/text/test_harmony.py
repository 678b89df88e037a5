"""GPT-OSS's Harmony format: output parsed into reasoning, text and calls, from text pieces at
any split and from a token stream; the real template rendered in Strata's sandbox; the stop
and shown tokens of a Harmony tokenizer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from strata.engine.text import IncrementalDetokenizer, load_text_assets
from strata.engine.text.harmony import HarmonyParser, analysis_is_open, template_is_harmony
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallArguments, CallStart, TextPiece
from tests.api.tiny_text import (
    HARMONY_TEMPLATE,
    write_tiny_harmony_dir,
    write_tiny_harmony_gguf,
)

ANALYSIS = "<|channel|>analysis<|message|>The user wants Paris weather. Use get_weather.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in <Paris>.<|return|>"

# (output, reasoning, text, calls as (name, arguments))
CASES = [
    (ANALYSIS + FINAL, "The user wants Paris weather. Use get_weather.",
     "It is sunny in <Paris>.", []),
    (ANALYSIS + CALL, "The user wants Paris weather. Use get_weather.", "",
     [("get_weather", '{"city": "Paris"}')]),
    # The recipient before the channel (as the template writes history), no constrain token.
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>'
     'commentary json<|message|>{"a": 1}', "x", "", [("f", '{"a": 1}')]),
    # A commentary preamble without a recipient is text; then a call, then nothing.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.now <|constrain|>json<|message|><|call|>", "", "Checking.", [("now", "{}")]),
    # Cut off by max_tokens inside the reasoning; and a header cut off before its body.
    ("<|channel|>analysis<|message|>Still thinking", "Still thinking", "", []),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|chan", "a", "", []),
    ("Plain text, no Harmony.", "", "Plain text, no Harmony.", []),
    # A model that skipped <|end|>: the next <|start|> ends the message.
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b",
     []),
]


def _run(pieces: list[str], **options) -> tuple[str, str, list[tuple[str, str]]]:
    parser = HarmonyParser(**options)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        elif isinstance(event, CallArguments):
            calls[event.index][1] += event.text
    return reasoning, text, [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize(("output", "reasoning", "text", "calls"), CASES)
def test_whole_and_per_character(output, reasoning, text, calls) -> None:
    assert _run([output]) == (reasoning, text, calls)
    assert _run(list(output)) == (reasoning, text, calls)  # every special token split


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_split_gives_the_same_result(case, cuts) -> None:
    output, *expected = case
    points = sorted({0, len(output), *(c % (len(output) + 1) for c in cuts)})
    pieces = [output[a:b] for a, b in itertools.pairwise(points)]
    assert _run(pieces) == tuple(expected)


def test_pieces_stream_before_the_message_ends() -> None:
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|message|>Thinking ab") == [Reasoning("Thinking ab")]
    assert parser.feed("out it<|e") == [Reasoning("out it")]  # '<|e' may begin <|end|>
    # The header is read only once <|message|> arrives.
    assert parser.feed("nd|><|start|>assistant<|channel|>commentary to=functions.f <|const") == []
    events = parser.feed('rain|>json<|message|>{"a"')
    assert events == [CallStart(0, "f"), CallArguments(0, '{"a"')]


def test_without_tools_a_call_is_text_and_a_forced_call_starts_in_its_header() -> None:
    assert _run([ANALYSIS + CALL], has_calls=False)[1:] == ('{"city": "Paris"}', [])
    prefix = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert _run(['{"city": "Oslo"}'], prefix=prefix) == (
        "", "", [("get_weather", '{"city": "Oslo"}')])


@pytest.fixture(scope="module")
def harmony_assets(tmp_path_factory):
    return load_text_assets(write_tiny_harmony_dir(tmp_path_factory.mktemp("harmony")))


def test_harmony_tokenizer_stops_at_return_and_call_not_end(harmony_assets) -> None:
    names = {harmony_assets.tokenizer.id_to_token(i) for i in harmony_assets.eos_token_ids}
    assert {"<|return|>", "<|call|>"} <= names
    assert "<|end|>" not in names  # it ends the analysis; the answer follows it


def test_a_harmony_gguf_gets_the_same_stops_and_shown_tokens(tmp_path, harmony_assets
                                                            ) -> None:
    model_dir = write_tiny_harmony_dir(tmp_path / "hf")
    gguf_assets = load_text_assets(write_tiny_harmony_gguf(tmp_path / "tiny.gguf", model_dir))
    names = {gguf_assets.tokenizer.id_to_token(i) for i in gguf_assets.eos_token_ids}
    assert {"<|return|>", "<|call|>"} <= names and "<|end|>" not in names
    assert gguf_assets.shown_special_ids == harmony_assets.shown_special_ids
    text = ANALYSIS + CALL
    assert gguf_assets.encode(text, add_special=False) == \
        harmony_assets.encode(text, add_special=False)


@pytest.mark.parametrize("output", [ANALYSIS + CALL, ANALYSIS + FINAL])
def test_parsed_from_a_token_stream(harmony_assets, output) -> None:
    """Token by token through the detokenizer, as a generation streams: the structure tokens
    come through as text, the stop tokens do not."""
    ids = harmony_assets.encode(output, add_special=False)
    assert harmony_assets.tokenizer.token_to_id("<|channel|>") in ids  # one special token each
    detokenizer = IncrementalDetokenizer(harmony_assets, skip_special=True)
    pieces = [detokenizer.push([i]) for i in ids] + [detokenizer.flush()]
    assert "<|call|>" not in "".join(pieces) and "<|return|>" not in "".join(pieces)
    expected = _run([output])
    assert _run(pieces) == expected and expected[0]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "City"},
                                         "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city"]}}}
HISTORY = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "thinking": "Call the tool.", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "assistant", "content": "Sunny.", "thinking": "It said sunny."},
    {"role": "user", "content": "And Oslo?"},
]


@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_real_template_renders_as_transformers_does(harmony_assets, effort) -> None:
    """Tools as a TypeScript namespace, the system message as developer instructions, the
    call and its result, the analysis dropped once a final answer followed it."""
    extra = {} if effort is None else {"reasoning_effort": effort}
    ours = harmony_assets.apply_chat_template(HISTORY, tools=[WEATHER], **extra)
    theirs = render_jinja_template([HISTORY], tools=[WEATHER], chat_template=HARMONY_TEMPLATE
                                   .read_text(), add_generation_prompt=True, **extra)[0][0]
    assert ours == theirs
    assert f"Reasoning: {effort or 'medium'}\n" in ours
    assert "type get_weather = (_: {\n// City\ncity: string,\nunit?: \"C\" | \"F\",\n}) =>" in ours
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>') in ours
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"' \
        in ours
    assert "Call the tool." not in ours and "It said sunny." not in ours  # a final followed
    assert ours.endswith("<|start|>user<|message|>And Oslo?<|end|><|start|>assistant")


def test_reasoning_before_a_call_stays_while_the_call_is_open(harmony_assets) -> None:
    ours = harmony_assets.apply_chat_template(HISTORY[:4], tools=[WEATHER])
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in ours


def test_template_is_harmony() -> None:
    assert template_is_harmony(HARMONY_TEMPLATE.read_text())
    templates = Path(__file__).parent / "templates"
    assert not any(template_is_harmony(p.read_text()) for p in templates.glob("*.jinja")
                   if p != HARMONY_TEMPLATE)


@pytest.mark.parametrize(("text", "is_open"), [
    ("<|channel|>analysis<|message|>still going", True),
    ("<|channel|>analysis<|message|>done<|end|>", False),
    ("<|channel|>analysis<|message|>done<|end|><|start|>assistant<|chan", False),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b",
     False),
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{", False),
    ('{"city": "Paris"', False),  # a forced call: its header was in the prompt
])
def test_analysis_is_open(text, is_open) -> None:
    assert analysis_is_open(text) is is_open
