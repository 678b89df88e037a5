"""A tiny real tokenizer directory whose vocabulary matches FakeEngine's token ids."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def write_tiny_model_dir(directory: Path, vocab_size: int = 512) -> Path:
    """tokenizer.json (word level: 'w3' is id 3) + tokenizer_config.json with a ChatML template."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
              "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
