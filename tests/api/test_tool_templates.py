"""Tools and tool histories rendered by real templates of each family (tests/text/templates).

The model's own template must receive the tools and the calls/results of the history in
Hugging Face's convention, and render what the family was trained on; templates without tools
get Strata's Hermes prompt. Checked on the rendered text, through plan_chat as requests do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from strata.engine.api.chat_plan import ChatInputs, plan_chat
from strata.engine.api.errors import ApiError
from strata.engine.api.tool_spec import Tool, ToolRequest

TEMPLATES = Path(__file__).parent.parent / "text" / "templates"
WEATHER = Tool("get_weather", "Weather of a city", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "abc123XYZ", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "abc123XYZ", "name": "get_weather"},
]

# template -> (text the tools render as, text the call renders as, text the result renders as)
EXPECTED = {
    "qwen2.5-instruct.jinja": ('"name": "get_weather"', ('<tool_call>\n{"name": "get_weather", '
                               '"arguments": {"city": "Paris"}}\n</tool_call>'),
                               "<tool_response>\nsunny\n</tool_response>"),
    "qwen3.jinja": ('"name": "get_weather"', ('<tool_call>\n{"name": "get_weather", '
                    '"arguments": {"city": "Paris"}}\n</tool_call>'),
                    "<tool_response>\nsunny\n</tool_response>"),
    "llama-3.1-instruct.jinja": ('"name": "get_weather"',
                                 '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                 # Llama's template writes a string result as JSON
                                 '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny"'),
    "mistral-nemo-instruct-2407.jinja": ('[AVAILABLE_TOOLS]', ('[TOOL_CALLS][{"name": '
                                         '"get_weather", "arguments": {"city": "Paris"}'),
                                         '[TOOL_RESULTS]{"content": sunny'),
    "glm-4.6.jinja": ('"name": "get_weather"', ("<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                      "<arg_value>Paris</arg_value>\n</tool_call>"),
                      "<|observation|>\n<tool_response>\nsunny\n</tool_response>"),
    "smollm2-135m-instruct.jinja": ("<tools>", ('<tool_call>\n{"name": "get_weather", '
                                    '"arguments": {"city": "Paris"}}\n</tool_call>'),
                                    "<tool_response>\nsunny\n</tool_response>"),
    # No tools in Gemma 3's template: Strata's Hermes prompt, its system message folded into
    # the first user turn and the results in a user turn, so the turns still alternate.
    "google-gemma-3-it.jinja": ("<start_of_turn>user\n# Tools", (
                                '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", '
                                '"arguments": {"city": "Paris"}}\n</tool_call><end_of_turn>'),
                                "<start_of_turn>user\n<tool_response>\nsunny\n"
                                "</tool_response><end_of_turn>\n<start_of_turn>model\n"),
    # Mistral Small 3.2 / Devstral: calls carry their 9-character id, as the template demands.
    "mistral-small-3.2-instruct-2506.jinja": (
        '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"',
        '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "Paris"}',
        "[TOOL_RESULTS]abc123XYZ[TOOL_CONTENT]sunny[/TOOL_RESULTS]"),
    # Phi-4-mini's template reads the tools from the system message (a JSON string) and
    # renders content only: the call goes into the content as the model writes calls.
    "microsoft-phi-4-mini-instruct.jinja": (
        '<|system|>You are a helpful assistant with some tools.<|tool|>[{"name": "get_weather", '
        '"description": "Weather of a city", "parameters": {"type": "object"',
        ('<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
         "<|/tool_call|><|end|>"), "<|tool|>sunny<|end|><|assistant|>"),
    # Phi-4's template has no tools: Strata's Hermes prompt, inside its own turns.
    "phi-4.jinja": ("<|im_start|>system<|im_sep|># Tools", (
        '<|im_start|>assistant<|im_sep|><tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'),
        "<|im_start|>user<|im_sep|><tool_response>\nsunny\n</tool_response><|im_end|>"),
}


@pytest.mark.parametrize("template", sorted(EXPECTED))
async def test_family_template_renders_tools_calls_and_results(client, text_assets,
                                                                template) -> None:
    assets = dataclasses.replace(text_assets, chat_template=(TEMPLATES / template).read_text())
    plan = await plan_chat(client.app, assets, ChatInputs(
        HISTORY, ToolRequest((WEATHER,), names=frozenset({"get_weather"}))))
    rendered = assets.decode(plan.prompt_ids, skip_special=False)
    for needle in EXPECTED[template]:
        assert needle in rendered, (needle, rendered)
    assert plan.tool_format is not None


async def test_forced_call_on_a_thinking_template_turns_thinking_off(client, text_assets
                                                                      ) -> None:
    assets = dataclasses.replace(text_assets,
                                 chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    tools = ToolRequest((WEATHER,), "named", "get_weather", True, frozenset({"get_weather"}))
    plan = await plan_chat(client.app, assets, ChatInputs(HISTORY[:1], tools))
    assert plan.grammar is not None and not plan.thinks
    assert assets.decode(plan.prompt_ids, skip_special=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(ApiError, match="thinking"):
        await plan_chat(client.app, assets, ChatInputs(HISTORY[:1], tools, thinking=True))


async def test_a_template_that_always_thinks_refuses_constrained_output(client, text_assets
                                                                         ) -> None:
    assets = dataclasses.replace(text_assets,
                                 chat_template=(TEMPLATES / "deepseek-r1.jinja").read_text())
    plan = await plan_chat(client.app, assets, ChatInputs(HISTORY[:1]))
    assert plan.thinks and plan.starts_thinking
    with pytest.raises(ApiError, match="thinking"):
        await plan_chat(client.app, assets,
                        ChatInputs(HISTORY[:1], output_grammar='{"grammars": []}'))


async def test_a_thinking_template_is_rendered_once_per_request(client, text_assets,
                                                                monkeypatch) -> None:
    """The prompt's text both tells whether it opened the think block and is tokenized: one
    render of a template from a model file, not two."""
    assets = dataclasses.replace(text_assets,
                                 chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    renders = []
    render = type(assets).apply_chat_template

    def counted(self, *args, **kwargs):
        renders.append(1)
        return render(self, *args, **kwargs)

    monkeypatch.setattr(type(assets), "apply_chat_template", counted)
    plan = await plan_chat(client.app, assets, ChatInputs(HISTORY[:1], thinking=True))
    assert plan.thinks and len(renders) == 1
    assert plan.prompt_ids == assets.encode_chat(HISTORY[:1], enable_thinking=True)
