"""Tool-call parsers of each family, on outputs in each family's format, whole and streamed.

The outputs are what the families' chat templates teach (tests/text/templates/ holds the real
templates): Qwen2.5/Qwen3 and Strata's own prompt write Hermes <tool_call> blocks, Llama 3.1+
writes a JSON object with "parameters", Mistral a [TOOL_CALLS] list, GLM-4.5 XML arguments
inside <tool_call>, Phi-4-mini a list between <|tool_call|> and <|/tool_call|>. Streaming must
give the same
calls and text as parsing the whole output, however the text is split.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.text import IncrementalDetokenizer, load_text_assets
from strata.engine.text.tool_calls import (
    CallArguments,
    CallStart,
    TextPiece,
    ToolCallParser,
    detect_format,
    parse_all,
)
from tests.api.tiny_text import write_tiny_phi4_dir

TEMPLATES = Path(__file__).parent / "templates"

# (format, output, expected text, expected [(name, arguments)])
RECORDED = [
    ("hermes",  # Qwen2.5-7B-Instruct, two parallel calls after a sentence
     ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"zone": "Europe/Paris"}}\n</tool_call>'),
     "Let me check.\n\n",
     [("get_weather", {"city": "Paris", "unit": "celsius"}),
      ("get_time", {"zone": "Europe/Paris"})]),
    ("hermes",  # Qwen3 after its thinking was split off; nested arguments with braces in strings
     ('<tool_call>\n{"name": "search", "arguments": {"q": "a } b { \\" c", "filters": '
     '{"tags": ["x", "y"], "n": 3}}}\n</tool_call>'),
     "", [("search", {"q": 'a } b { " c', "filters": {"tags": ["x", "y"], "n": 3}})]),
    ("hermes", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("hermes", "a <tool_ b", "a <tool_ b", []),
    ("llama3",  # Llama 3.1 JSON tool calling
     '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3",  # Llama 3.2: several calls separated by semicolons
     '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"x": 1}), ("b", {})]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("mistral",  # Mistral v3 (7B-Instruct-v0.3): arguments given as an object
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral",  # the [TOOL_CALLS] control token removed by the detokenizer
     '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "neg", "arguments": {"a": 3}}]',
     "", [("add", {"a": 1, "b": 2}), ("neg", {"a": 3})]),
    ("mistral",  # Mistral Small 3.2 (v11 tokenizer): name, [ARGS], arguments; two calls
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "q": "a}\\"b"}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", {"city": "Paris", "q": 'a}"b'}), ("get_time", {})]),
    ("mistral",  # Mistral Small 3.2 / Devstral as their template writes calls: a call id
     '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", "Bonjour! Paris is sunny.", "Bonjour! Paris is sunny.", []),
    ("generic",  # arguments as a JSON string, name after arguments
     '{"arguments": "{\\"city\\": \\"Rome\\"}", "name": "get_weather"}', "",
     [("get_weather", {"city": "Rome"})]),
    ("generic", '{"a": 1} is JSON', '{"a": 1} is JSON', []),
    ("generic", "Hi {\"name\": \"x\"}", "Hi {\"name\": \"x\"}", []),
    ("glm",  # GLM-4.5 after its thinking was split off: a sentence, two calls; values are
     # JSON where they parse (the template tojson's non-strings), else strings
     ('Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York'
      '</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts'
      '</arg_key>\n<arg_value>{"unit": "C", "hours": [6, 12]}</arg_value>\n</tool_call>\n'
      '<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>a < b "c"</arg_value>\n'
      '</tool_call>'),
     "Let me check.\n\n",
     [("get_weather", {"city": "New York", "days": 3, "opts": {"unit": "C", "hours": [6, 12]}}),
      ("get_time", {"zone": 'a < b "c"'})]),
    ("glm",  # a call without arguments, its name right before the end tag
     "<tool_call>list_files</tool_call>", "", [("list_files", {})]),
    ("glm", "Paris is in France; <tool is a word.", "Paris is in France; <tool is a word.", []),
    ("phi4",  # Phi-4-mini: a sentence, then its call tokens around a list of two calls
     ('Let me check.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
      '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]'
      '<|/tool_call|>'),
     "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]),
    ("phi4",  # arguments as a JSON string, brackets inside strings, text after the calls
     ('<|tool_call|>[{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": [2]}"}, {"name": '
      '"find", "arguments": {"q": "a ] b [ }", "in": [{"x": 1}]}}]<|/tool_call|>\nDone.'),
     "\nDone.", [("add", {"a": 1, "b": [2]}), ("find", {"q": "a ] b [ }", "in": [{"x": 1}]})]),
    ("phi4",  # as llama.cpp's template for Phi-4-mini teaches: one object per block
     ('<|tool_call|>{"name": "a", "arguments": {}}<|/tool_call|><|tool_call|>{"name": "b", '
      '"arguments": {"k": 1}}<|/tool_call|>'), "", [("a", {}), ("b", {"k": 1})]),
    ("phi4",  # the call tokens hidden (a detokenizer that skips special tokens): a bare list
     '[{"name": "f", "arguments": {"q": "x"}}]', "", [("f", {"q": "x"})]),
    ("phi4",  # the output stopped before <|/tool_call|>
     '<|tool_call|>[{"name": "f", "arguments": {}}]', "", [("f", {})]),
    ("phi4", "The list is [1, 2].", "The list is [1, 2].", []),
    ("phi4", "[1, 2] are the numbers.", "[1, 2] are the numbers.", []),
    # Malformed calls are the model's text, as it wrote it, tokens included.
    ("phi4", '<|tool_call|>get_weather(city="Paris")<|/tool_call|> ok',
     '<|tool_call|>get_weather(city="Paris")<|/tool_call|> ok', []),
    ("phi4", 'x <|tool_call|>[{"city": "Paris"}]<|/tool_call|>',
     'x <|tool_call|>[{"city": "Paris"}]<|/tool_call|>', []),
    ("phi4", '<|tool_call|>[{"nam', '<|tool_call|>[{"nam', []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
]


def _collect(events) -> tuple[str, list[tuple[str, dict]]]:
    text, calls = "", []
    for event in events:
        if isinstance(event, TextPiece):
            text += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        else:
            assert isinstance(event, CallArguments)
            calls[event.index][1] += event.text
    return text, [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), RECORDED)
def test_whole_output(fmt, output, text, calls) -> None:
    got_text, got_calls = parse_all(fmt, output)
    assert got_text == text
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls


@pytest.mark.parametrize(("fmt", "output", "text", "calls"), RECORDED)
def test_streamed_one_character_at_a_time(fmt, output, text, calls) -> None:
    parser = ToolCallParser(fmt)
    events = [e for char in output for e in parser.feed(char)] + parser.finish()
    assert _collect(events) == (text, calls)


def test_arguments_stream_in_pieces_after_the_name() -> None:
    parser = ToolCallParser("hermes")
    first = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert first[0] == CallStart(0, "f")
    assert "".join(e.text for e in first[1:]).startswith('{"city": "P')
    rest = parser.feed('ris"}}\n</tool_call>') + parser.finish()
    assert "".join(e.text for e in first[1:] + rest) == '{"city": "Paris"}'


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(RECORDED), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_split_gives_the_whole_result(case, cuts) -> None:
    fmt, output, text, calls = case
    points = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *points], [*points, len(output)])]
    parser = ToolCallParser(fmt)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    assert _collect(events) == (text, calls)


@pytest.mark.parametrize(("template", "fmt"), [
    ("qwen2.5-instruct.jinja", "hermes"), ("qwen3.jinja", "hermes"),
    ("hermes-3-llama-3.1-tool-use.jinja", "hermes"), ("llama-3.1-instruct.jinja", "llama3"),
    ("mistral-nemo-instruct-2407.jinja", "mistral"),
    ("mistral-small-3.2-instruct-2506.jinja", "mistral"), ("smollm2-135m-instruct.jinja", "hermes"),
    ("phi-4.jinja", "hermes"), ("microsoft-phi-4-mini-instruct.jinja", "phi4"),
    ("llama-cpp-microsoft-phi-4-mini-instruct.jinja", "phi4"),
    ("glm-4.6.jinja", "glm"), ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral")])
def test_format_is_detected_from_the_real_template(template, fmt) -> None:
    path = TEMPLATES / template
    assert detect_format(path.read_text()) == fmt


def test_glm_call_streams_its_name_then_each_argument_as_it_closes() -> None:
    parser = ToolCallParser("glm")
    assert parser.feed("Ok.\n<tool_call>get_weather\n<arg_key>ci") == [
        TextPiece("Ok.\n"), CallStart(0, "get_weather")]
    assert parser.feed("ty</arg_key>\n<arg_value>Par") == []  # a value is whole or nothing
    assert parser.feed("is</arg_value>\n<arg_") == [CallArguments(0, '{"city": "Paris"')]
    assert parser.feed("key>n</arg_key><arg_value>2</arg_value></tool_call>") == [
        CallArguments(0, ', "n": 2}')]
    assert parser.finish() == []


@pytest.fixture(scope="module")
def phi4_assets(tmp_path_factory):
    return load_text_assets(write_tiny_phi4_dir(tmp_path_factory.mktemp("phi4")))


def test_phi4_calls_parsed_from_a_token_stream(phi4_assets) -> None:
    """Token by token through the detokenizer, as a generation streams: Phi-4-mini's call
    tokens are special tokens, and still reach the parser as text."""
    output = ('Sure.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", '
              '"days": 3}}]<|/tool_call|>')
    ids = phi4_assets.encode(output, add_special=False)
    assert phi4_assets.tokenizer.token_to_id("<|tool_call|>") in ids  # one special token
    detokenizer = IncrementalDetokenizer(phi4_assets, skip_special=True)
    parser = ToolCallParser(detect_format(phi4_assets.chat_template))
    events = [e for i in ids for e in parser.feed(detokenizer.push([i]))]
    events += parser.feed(detokenizer.flush()) + parser.finish()
    assert _collect(events) == ("Sure.", [("get_weather", {"city": "Paris", "days": 3})])
    # Other special tokens stay hidden: the turn's end is no text.
    assert phi4_assets.decode(phi4_assets.encode("Hi<|end|>", add_special=False)) == "Hi"
    detokenizer = IncrementalDetokenizer(phi4_assets, skip_special=True)
    assert detokenizer.push(phi4_assets.encode("Hi<|end|>", add_special=False)) == "Hi"


def test_phi4_call_streams_once_its_name_is_known() -> None:
    parser = ToolCallParser("phi4")
    assert parser.feed("Ok.<|tool_") == [TextPiece("Ok.")]  # maybe the call token: held
    assert parser.feed('call|>[{"name": "f", "argu') == [CallStart(0, "f")]
    assert parser.feed('ments": {"a": [1') == [CallArguments(0, '{"a": [')]
    assert parser.feed("]}}]<|/tool_") == [CallArguments(0, "1]}")]
    assert parser.feed("call|> Done") == [TextPiece(" Done")]
    assert parser.finish() == []


def test_ministral3_template_writes_calls_the_mistral_parser_reads_back() -> None:
    """Ministral 3's real template writes each earlier call as `[TOOL_CALLS]name[ARGS]{...}`;
    the same text from the model (two calls) parses into those calls."""
    from strata.engine.text.chat_template import ChatTemplate

    source = (TEMPLATES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]},
        {"role": "tool", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, tools=tools)
    written = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}'
    assert written + "</s>[TOOL_RESULTS]sunny[/TOOL_RESULTS]" in text
    assert "[AVAILABLE_TOOLS]" in text
    parser = ToolCallParser(detect_format(source))
    assert _collect(parser.feed(written) + parser.finish()) == ("", calls)
