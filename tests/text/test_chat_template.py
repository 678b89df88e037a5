"""Chat templates: SmolLM2's real one, the ChatML fallback, and hostile templates."""

from __future__ import annotations

import time

import pytest

from strata.engine.text import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi, 東京?"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "🚀"},
]


def test_smollm2_template_renders_chatml_in_order(smollm2):
    text = smollm2.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    expected = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION]
    assert text == "".join(expected) + "<|im_start|>assistant\n"
    without = smollm2.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert without == "".join(expected)


def test_smollm2_template_adds_default_system_prompt(smollm2):
    text = smollm2.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_encode_chat_matches_render_and_adds_no_second_bos(smollm2):
    ids = smollm2.encode_chat(CONVERSATION)
    assert smollm2.decode(ids, skip_special=False) == smollm2.apply_chat_template(CONVERSATION)
    assert ids[0] == smollm2.bos_token_id and ids[1] != smollm2.bos_token_id


def test_hf_environment_features():
    source = ("{{ messages | tojson }}|{% for m in messages %}{% if loop.index > 1 %}{% break %}"
              "{% endif %}{{ m.role }}{% endfor %}|{% generation %}gen{% endgeneration %}|"
              "{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ tools }}")
    text = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(CONVERSATION[:2])
    assert text.startswith('[{"role": "system", "content": "Be brief."}, {"role": "user", '
                           '"content": "Hi, 東京?"}]')
    assert text.endswith("|system|gen|<s></s>|4|None")


def test_trim_and_lstrip_blocks_like_hf():
    source = "{% for m in messages %}\n    {% if m %}{{ m.content }}{% endif %}\n{% endfor %}"
    assert ChatTemplate(source).render([{"role": "u", "content": "a"}] * 2) == "aa"


def test_fallback_chatml_for_models_without_template():
    text = ChatTemplate(CHATML_TEMPLATE).render(CONVERSATION[1:2], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi, 東京?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}",
    "{% for i in range(99999) recursive %}{{ loop(range(99999)) }}{% endfor %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ 'x' * 10000000000 }}",
])
def test_looping_template_raises_quickly(source):
    started_s = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, max_render_s=0.5).render(CONVERSATION)
    assert time.monotonic() - started_s < 5.0
    assert "\n" not in str(info.value)


def test_template_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match="rejected these messages: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": ["a", "list"]}])


def test_sandbox_hides_internals():
    assert ChatTemplate("{{ messages.__class__ }}").render(CONVERSATION) == ""
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(CONVERSATION)


def test_gemma3_template_folds_the_system_prompt_into_the_first_user_turn():
    from pathlib import Path

    source = (Path(__file__).parent / "templates" / "google-gemma-3-it.jinja").read_text()
    template = ChatTemplate(source, bos_token="<bos>", eos_token="<eos>")
    text = template.render(CONVERSATION, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi, 東京?<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\n🚀<end_of_turn>\n<start_of_turn>model\n")
    # Gemma's template is strict about turns; its own message reaches the caller, one line.
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
