"""llama.cpp's POST /infill: fill in the middle between input_prefix and input_suffix, for
editor plugins (llama.vscode, llama.vim).

The prompt is the model's own FIM layout (text/fim.py): the extra files of input_extra, each
after the file separator token, then <prefix> input_prefix <suffix> input_suffix <middle>
prompt; the model writes the middle. The rest of the request and the answer are /completion's.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata.engine.api import validation as v
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import bad_request
from strata.engine.api.llama_answer import parse_answer_options
from strata.engine.api.llama_completion import (
    COMPLETION_FIELDS,
    answer_completion,
    parse_completion,
)
from strata.engine.api.model_routing import service_of
from strata.engine.api.textgen import text_assets
from strata.engine.text.fim import FimTokens, fim_tokens

INFILL_FIELDS = COMPLETION_FIELDS | {"input_prefix", "input_suffix", "input_extra"}


def _text(body: dict, name: str) -> str:
    value = body.get(name, "")
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", param=name)
    return value


def _extra(body: dict) -> list[tuple[str, str]]:
    """input_extra: [{"filename": ..., "text": ...}, ...], context from other files."""
    raw = body.get("input_extra") or []
    if not isinstance(raw, list):
        raise bad_request("'input_extra' must be a list of {filename, text}", param="input_extra")
    chunks = []
    for i, chunk in enumerate(raw):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) or \
                not isinstance(chunk.get("filename", ""), str):
            raise bad_request(f"input_extra[{i}] must be {{'filename': str, 'text': str}}",
                              param="input_extra")
        chunks.append((chunk.get("filename", ""), chunk.get("text", "")))
    return chunks


def infill_prompt(assets: Any, fim: FimTokens, prefix: str, suffix: str, prompt: str,
                  extra: list[tuple[str, str]]) -> list[int]:
    """The FIM prompt's token ids (prefix-suffix-middle order, as llama.cpp writes it)."""
    def encode(text: str) -> list[int]:
        return assets.encode(text, add_special=False) if text else []

    ids = [assets.bos_token_id] if assets.add_bos and assets.bos_token_id is not None else []
    for filename, text in extra:
        ids += [fim.file_sep, *encode(f"{filename}\n{text}" if filename else text)]
    if extra:
        ids.append(fim.file_sep)  # the file being edited starts here
    return [*ids, fim.prefix, *encode(prefix), fim.suffix, *encode(suffix), fim.middle,
            *encode(prompt)]


async def infill(request: web.Request) -> web.StreamResponse:
    """POST /infill."""
    service = service_of(request)
    body = await v.read_json_object(request)
    params = parse_completion(body, INFILL_FIELDS, "/infill")
    prefix, suffix = _text(body, "input_prefix"), _text(body, "input_suffix")
    prompt, extra = _text(body, "prompt"), _extra(body)
    assets = text_assets(service)
    fim = fim_tokens(assets)
    if fim is None:
        raise bad_request(f"{service.model_id} cannot fill in the middle: its vocabulary has no "
                          "FIM tokens (<|fim_prefix|>, <fim_prefix>, <PRE>, ...); use a code "
                          "model trained for it, such as Qwen2.5-Coder", param="input_prefix")
    if extra and fim.file_sep is None:
        raise bad_request(f"{service.model_id}'s vocabulary has no file separator token "
                          "(<|file_sep|>) to put input_extra in; leave it out",
                          param="input_extra")
    prompt_ids = await run_cpu(request.app, infill_prompt, assets, fim, prefix, suffix, prompt,
                               extra)
    return await answer_completion(request, assets, prompt_ids, params,
                                   parse_answer_options(body))
