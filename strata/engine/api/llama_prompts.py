"""The prompt forms llama.cpp's /completion takes, as token id lists.

One prompt is a string, a list of token ids, a list mixing ids and strings (the strings are
tokenized in place), {"prompt_string": "..."} or {"content": [text parts]}; a list of prompts
(strings, id lists, objects) is a batch, answered as a list. The embedding routes take the same
forms. `multimodal_data` and non-text parts are refused: Strata serves text models.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import bad_request
from strata.engine.text.assets import TextAssets

MAX_PROMPTS = 64  # prompts in one batch request; each is a generation queued at once
_PROMPT_STRING = "prompt_string"


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_single_prompt(prompt: Any) -> bool:
    """A string, an object, or a list of ids and strings with at least one id."""
    if not isinstance(prompt, list):
        return True
    return (all(_is_id(p) or isinstance(p, str) for p in prompt)
            and any(_is_id(p) for p in prompt))


def _object_text(prompt: dict, name: str) -> str:
    """The text of {"prompt_string": text} or {"content": [{"type": "text", "text"}, ...]}."""
    if prompt.get("multimodal_data") is not None:
        raise bad_request("'multimodal_data' is not supported; Strata serves text models",
                          param=name)
    unknown = sorted(set(prompt) - {_PROMPT_STRING, "content", "multimodal_data"})
    if unknown:
        raise bad_request(f"'{name}' object field {unknown[0]!r} is not supported; send "
                          f"{{\"{_PROMPT_STRING}\": text}} or {{\"content\": [text parts]}}",
                          param=name)
    if isinstance(prompt.get(_PROMPT_STRING), str) and "content" not in prompt:
        return str(prompt[_PROMPT_STRING])
    parts = prompt.get("content")
    if not isinstance(parts, list) or not parts or _PROMPT_STRING in prompt:
        raise bad_request(f"'{name}' object needs a string '{_PROMPT_STRING}' or a list of "
                          "text parts in 'content'", param=name)
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"'{name}' has a content part of type {kind!r}; only text parts "
                              "are supported (Strata serves text models)", param=name)
        texts.append(part["text"])
    return "".join(texts)


def tokenize_prompt(assets: TextAssets, prompt: Any, name: str = "prompt") -> list[int]:
    """One prompt's token ids; the special tokens (BOS) come with its first text piece only."""
    if isinstance(prompt, dict):
        prompt = _object_text(prompt, name)
    pieces = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(pieces, list):
        pieces = [None]  # refused below with the forms that are accepted
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += assets.encode(piece, add_special=i == 0)
        elif _is_id(piece):
            if not 0 <= piece < assets.vocab_size:
                raise bad_request(f"'{name}' token id {piece} is outside 0.."
                                  f"{assets.vocab_size - 1}", param=name)
            ids.append(piece)
        else:
            raise bad_request(f"'{name}' must be a string, a list of token ids and strings, "
                              f"an object with '{_PROMPT_STRING}' or 'content', or a list of "
                              "those", param=name)
    if not ids:
        raise bad_request(f"'{name}' is empty; send some text", param=name)
    return ids


def _token_lists(assets: TextAssets, prompt: Any) -> tuple[list[list[int]], bool]:
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if is_single_prompt(prompt):
        return [tokenize_prompt(assets, prompt)], False
    if not prompt:
        raise bad_request("'prompt' is an empty list; send some text", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} in one "
                          "request", param="prompt")
    # A batch of one answers as one object, as llama.cpp's does.
    return [tokenize_prompt(assets, p) for p in prompt], len(prompt) > 1


async def llama_prompts(app: web.Application, assets: TextAssets, prompt: Any
                        ) -> tuple[list[list[int]], bool]:
    """(token ids of each prompt, whether to answer a list), tokenized off the loop."""
    return await run_cpu(app, _token_lists, assets, prompt)
