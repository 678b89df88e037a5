"""A tiny real byte-level BPE tokenizer with a ChatML template, written to a model directory."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Hello world! The answer is 42.", "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.", "What is the answer to everything?",
    "héllo wörld ✓ café naïve", "stop here. STOP now. The end.",
] * 20


def write_tiny_model_dir(directory: Path, *, vocab_size: int = 300) -> Path:
    """Train a small byte-level BPE and save tokenizer.json + tokenizer_config.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(_CORPUS, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None,
              "pad_token": "<|endoftext|>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


HARMONY_SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
                          "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
HARMONY_TEMPLATE = Path(__file__).parent.parent / "text" / "templates" / \
    "openai-gpt-oss-120b.jinja"
_HARMONY_CORPUS = [
    "analysis final commentary functions get_weather json assistant user system developer",
    "The user asks about the weather in Paris. It is sunny.", "Reasoning: low medium high",
] * 20


def _byte_level_bpe(vocab_size: int, special_tokens: list[str], corpus: list[str]) -> Tokenizer:
    """A byte-level BPE trained on corpus, with these special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def _save(directory: Path, tokenizer: Tokenizer, template: Path, *, eos: str, bos: str,
          pad: str) -> None:
    """tokenizer.json and a tokenizer_config.json with the real chat template, as a Hugging
    Face directory has them (no BOS added)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": template.read_text(), "eos_token": eos, "bos_token": bos,
              "pad_token": pad, "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_harmony_dir(directory: Path, *, vocab_size: int = 400) -> Path:
    """A byte-level BPE with gpt-oss's special tokens and its real chat template, written as
    gpt-oss's Hugging Face directory has them (eos <|return|>; <|call|> and <|endoftext|> as
    further end ids in generation_config.json)."""
    tokenizer = _byte_level_bpe(vocab_size, HARMONY_SPECIAL_TOKENS, _CORPUS + _HARMONY_CORPUS)
    _save(directory, tokenizer, HARMONY_TEMPLATE, eos="<|return|>", bos="<|startoftext|>",
          pad="<|endoftext|>")
    end_ids = [tokenizer.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": end_ids}))
    return directory


def write_tiny_harmony_gguf(path: Path, model_dir: Path) -> Path:
    """The tiny Harmony tokenizer (write_tiny_harmony_dir's) as a GGUF vocabulary the way
    llama.cpp's converter writes gpt-oss's: BPE with the gpt-4o pre-tokenizer, the special
    tokens as CONTROL, eos <|return|>, the template in the metadata. `<|end|>` is written
    as the eot token, the worst case a converter could write: it must still not stop."""
    import gguf  # only the GGUF tests need it

    data = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = set(HARMONY_SPECIAL_TOKENS)
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|startoftext|>"])
    writer.add_eos_token_id(vocab["<|return|>"])
    writer.add_eot_token_id(vocab["<|end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(HARMONY_TEMPLATE.read_text())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PHI4_SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
                       "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>",
                       "<|tool_response|>"]
PHI4_TEMPLATE = Path(__file__).parent.parent / "text" / "templates" / \
    "microsoft-phi-4-mini-instruct.jinja"


def write_tiny_phi4_dir(directory: Path, *, vocab_size: int = 400) -> Path:
    """A byte-level BPE with Phi-4-mini's chat and tool tokens (all special, as in its
    tokenizer.json) and its real chat template; eos <|endoftext|>, <|end|> ends a turn."""
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'] * 20
    tokenizer = _byte_level_bpe(vocab_size, PHI4_SPECIAL_TOKENS, _CORPUS + corpus)
    _save(directory, tokenizer, PHI4_TEMPLATE, eos="<|endoftext|>", bos="<|endoftext|>",
          pad="<|endoftext|>")
    return directory


# Tekken's control tokens that Ministral 3 Reasoning's template writes, all special as in its
# tokenizer.json (decode(skip_special) would drop them).
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                          "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                          "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]
MINISTRAL_REASONING_TEMPLATE = Path(__file__).parent.parent / "text" / "templates" / \
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja"


def write_tiny_ministral_reasoning_dir(directory: Path, *, vocab_size: int = 400,
                                       words: tuple[str, ...] = (),
                                       template: Path = MINISTRAL_REASONING_TEMPLATE) -> Path:
    """A byte-level BPE with Tekken's control tokens (special) and Ministral 3 Reasoning's real
    chat template (or another); bos <s>, eos </s>. `words` are added as whole (non-special)
    tokens."""
    corpus = ['get_weather {"city": "Paris", "days": 3} The user wants the weather.'] * 20
    tokenizer = _byte_level_bpe(vocab_size, MISTRAL_SPECIAL_TOKENS, _CORPUS + corpus)
    if words:
        tokenizer.add_tokens(list(words))
    _save(directory, tokenizer, template, eos="</s>", bos="<s>",
          pad="<unk>")
    return directory
