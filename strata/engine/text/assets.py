"""Everything the host needs to turn chat messages into token ids and back, without torch.

`load_text_assets(path)` reads a GGUF file's vocabulary metadata or a Hugging Face directory's
tokenizer files, so tokenizing, token counting and templating work while the model is unloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from strata.engine.gguf_file import model_path_problem
from strata.engine.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from strata.engine.text.errors import ChatTemplateError, TextAssetsError
from strata.engine.text.gguf_tokenizer import (
    build_tokenizer,
    read_gguf_vocab,
    set_special_post_processor,
)
from strata.engine.text.harmony import harmony_token_ids, template_is_harmony
from strata.engine.text.reasoning import MISTRAL_THINK, think_tags
from strata.engine.text.tool_calls import SHOWN_TOKENS, detect_format

__all__ = ["ChatTemplateError", "TextAssets", "TextAssetsError", "load_text_assets"]

# Tokens that end an assistant turn in common templates; they stop generation like EOS does.
_TURN_END_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
    "<end_of_turn>", "<|return|>",
)


@dataclass
class TextAssets:
    """Tokenizer, chat template and special tokens of one model."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    vocab_size: int
    source: str = ""
    # Special tokens whose text the output keeps (Harmony's structure tokens, read by its parser).
    shown_special_ids: frozenset[int] = frozenset()
    _compiled: ChatTemplate | None = field(default=None, init=False, repr=False)
    _compile_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens (<|im_start|>, BOS, EOS...): decode(skip_special) drops them."""
        return self._special_ids

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        added = self.tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special)

    @property
    def bos_token(self) -> str:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of text; add_special adds BOS when the model wants it."""
        # encode_batch releases the GIL while it works (encode does not), so a long text
        # tokenized on a worker thread leaves the server's event loop free.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special)[0].ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of token ids; skip_special drops control tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render messages with the model's template (ChatML when it has none).

        Extra keywords (tools, enable_thinking, ...) are passed to the template.
        Raises ChatTemplateError with a one-line message.
        """
        return self._template().render(messages, add_generation_prompt=add_generation_prompt,
                                       **extra)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Prompt token ids for messages: apply_chat_template, then encode_rendered."""
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt,
                                                             **extra))

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a prompt apply_chat_template rendered; BOS appears once even if the
        template writes it."""
        ids = self.encode(text, add_special=False)
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def _template(self) -> ChatTemplate:
        with self._compile_lock:
            if self._compiled is None:
                self._compiled = ChatTemplate(
                    self.chat_template or CHATML_TEMPLATE,
                    bos_token=self.bos_token, eos_token=self.eos_token,
                )
            return self._compiled


def load_text_assets(path: str | Path) -> TextAssets:
    """Text assets of a .gguf file or a Hugging Face model directory.

    Cached per file version, so repeated calls for the same model are free.
    Raises TextAssetsError (one line) when the files cannot be used.
    """
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError:
        raise TextAssetsError(
            f"model path {path} does not exist; pass a .gguf file or a Hugging Face model directory"
        ) from None
    problem = model_path_problem(path)  # a FIFO or device: opening it would block
    if problem is not None:
        raise TextAssetsError(problem)
    return _load_cached(str(path.resolve()), _version_key(path, stat.st_mtime_ns))


_HF_TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                  "chat_template.json", "generation_config.json", "config.json")


def _version_key(path: Path, mtime_ns: int) -> tuple[int, ...]:
    """Changes when any file the assets are built from changes, so the cache never goes stale."""
    if not path.is_dir():
        return (mtime_ns,)
    return tuple((path / name).stat().st_mtime_ns if (path / name).exists() else 0
                 for name in _HF_TEXT_FILES)


@functools.lru_cache(maxsize=4)
def _load_cached(path_str: str, _version: tuple[int, ...]) -> TextAssets:
    path = Path(path_str)
    if path.is_dir():
        return _load_hf_dir(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise TextAssetsError(
            f"{path} is neither a GGUF file nor a directory; pass a .gguf file or a Hugging Face "
            "model directory"
        )
    return _load_gguf(path)


def _load_gguf(path: Path) -> TextAssets:
    vocab = read_gguf_vocab(path)
    tokenizer = build_tokenizer(vocab)
    eos = [i for i in (vocab.eos_token_id, vocab.eot_token_id, vocab.eom_token_id) if i is not None]
    return _by_format(TextAssets(
        tokenizer=tokenizer, chat_template=vocab.chat_template,
        bos_token_id=vocab.bos_token_id, eos_token_ids=_with_turn_ends(tokenizer, eos),
        add_bos=vocab.add_bos and vocab.bos_token_id is not None,
        vocab_size=len(vocab.tokens), source=str(path),
    ))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TextAssetsError(f"cannot parse {path} ({exc}); fix or re-download the file") from exc


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "text" or {"content": "text", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids_of(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _load_hf_dir(directory: Path) -> TextAssets:
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TextAssetsError(
            f"{directory} has no tokenizer.json; Strata needs the fast-tokenizer file "
            "(save it with tokenizer.save_pretrained)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises plain Exception
        raise TextAssetsError(f"cannot load {tokenizer_file} ({exc}); re-download it") from exc
    config = _read_json(directory / "tokenizer_config.json")
    bos_text = _token_content(config.get("bos_token"))
    eos_text = _token_content(config.get("eos_token"))
    bos_id = tokenizer.token_to_id(bos_text) if bos_text else None
    eos = [tokenizer.token_to_id(eos_text)] if eos_text else []
    # generation_config.json / config.json often list more end ids (Llama 3: eot and eom).
    for extra in ("generation_config.json", "config.json"):
        data = _read_json(directory / extra)
        eos += _ids_of(data.get("eos_token_id"))
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # no flag: keep what tokenizer.json's post-processor does
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and probe[:1] == [bos_id]
    add_bos = bool(add_bos) and bos_id is not None
    set_special_post_processor(tokenizer, bos_text if add_bos else None, None)
    return _by_format(TextAssets(
        tokenizer=tokenizer, chat_template=_hf_chat_template(directory, config),
        bos_token_id=bos_id, eos_token_ids=_with_turn_ends(tokenizer, eos), add_bos=add_bos,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), source=str(directory),
    ))


def _by_format(assets: TextAssets) -> TextAssets:
    """A Harmony model (gpt-oss) stops at <|return|> and <|call|>, not <|end|>, and shows the
    structure tokens its output parser reads (text/harmony.py); a family whose call markers
    or think tags are special tokens (Phi-4-mini's <|tool_call|>, Mistral's [TOOL_CALLS] and
    [THINK]) shows them (text/tool_calls.py, text/reasoning.py)."""
    if not template_is_harmony(assets.chat_template):
        names = SHOWN_TOKENS.get(detect_format(assets.chat_template), ())
        tags = think_tags(assets.chat_template)
        if tags == MISTRAL_THINK:
            names = (*names, tags.start, tags.end)
        shown = frozenset(i for i in map(assets.tokenizer.token_to_id, names) if i is not None)
        return dataclasses.replace(assets, shown_special_ids=shown) if shown else assets
    stops, shown = harmony_token_ids(assets.tokenizer, assets.eos_token_ids)
    return dataclasses.replace(assets, eos_token_ids=stops, shown_special_ids=shown)


def _with_turn_ends(tokenizer: Tokenizer, eos_ids: list[int | None]) -> tuple[int, ...]:
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    turn_ends = [tokenizer.token_to_id(t) for t in _TURN_END_TOKENS]
    ids = [i for i in eos_ids if i is not None]
    ids += [i for i in turn_ends if i is not None and i in special]
    return tuple(dict.fromkeys(ids))
