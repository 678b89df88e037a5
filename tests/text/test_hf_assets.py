"""TextAssets from a Hugging Face directory, with a tokenizer.json built here by `tokenizers`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from strata.engine.text import TextAssetsError, load_text_assets

SPECIALS = ["<s>", "</s>", "<|eot_id|>", "<|im_end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}<|eot_id|>"
            "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def write_hf_dir(directory: Path, *, config: dict, bos_post_processor: bool = False) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["Hello world, the user and the assistant. 東京 🚀"] * 50, trainer)
    if bos_post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_llama_style_directory(tmp_path):
    directory = write_hf_dir(tmp_path / "m", config={
        "bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
        "add_bos_token": True, "chat_template": TEMPLATE})
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assets = load_text_assets(directory)
    assert assets.bos_token_id == 0 and assets.add_bos
    assert assets.eos_token_ids[:2] == (1, 2) and 3 in assets.eos_token_ids  # + <|im_end|>
    assert assets.encode("Hello")[0] == 0 and assets.encode("Hello", add_special=False)[0] != 0
    messages = [{"role": "user", "content": "Hello 東京"}]
    assert assets.apply_chat_template(messages) == "<s>[user]Hello 東京<|eot_id|>[assistant]"
    ids = assets.encode_chat(messages)
    assert ids[0] == 0 and ids[1] != 0  # the template wrote BOS; no second one
    assert assets.decode(ids) == "[user]Hello 東京[assistant]"
    assert {0, 1, 2, 3} <= assets.special_token_ids
    assert assets.vocab_size == assets.tokenizer.get_vocab_size(with_added_tokens=True)


def test_chat_template_jinja_file_wins_and_bos_detected(tmp_path):
    directory = write_hf_dir(tmp_path / "m", config={"bos_token": "<s>", "eos_token": "</s>",
                                                     "chat_template": "ignored"},
                             bos_post_processor=True)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "chat_template.jinja").write_text(template)
    assets = load_text_assets(directory)
    assert assets.add_bos  # no add_bos_token flag: tokenizer.json's post-processor decides
    assert assets.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert assets.encode_chat([{"role": "user", "content": "hi"}])[0] == 0


def test_no_template_falls_back_to_chatml_and_no_bos(tmp_path):
    assets = load_text_assets(write_hf_dir(tmp_path / "m", config={"eos_token": "<|im_end|>"}))
    assert assets.bos_token_id is None and not assets.add_bos
    text = assets.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert assets.eos_token_ids == (3, 2)  # <|eot_id|> is a special turn end in this vocab


def test_directory_without_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TextAssetsError, match=r"no tokenizer.json"):
        load_text_assets(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TextAssetsError, match="cannot load"):
        load_text_assets(tmp_path)
