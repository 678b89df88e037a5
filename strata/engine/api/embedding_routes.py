"""Embeddings in each dialect: OpenAI /v1/embeddings (and /embeddings), llama.cpp /embedding,
Ollama /api/embed and the older /api/embeddings.

Every route tokenizes on the host and asks the service for one vector per input (Service.embed:
the model's final hidden states, pooled, L2-normalized; text/embedding_spec.py says which
pooling). Inputs longer than the context are a 400, except where Ollama truncates by default.
A request holds at most MAX_EMBED_INPUTS inputs and MAX_EMBED_TOKENS tokens in all (413 past
either, docs/api.md); the engine runs it a few inputs at a time beside the chats, and a client
that leaves cancels the rest.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from strata.engine.api import validation as v
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import SETTINGS_KEY
from strata.engine.api.llama_prompts import is_single_prompt, tokenize_prompt
from strata.engine.api.model_routing import apply_ttl, service_of
from strata.engine.api.ollama_params import parse_keep_alive
from strata.engine.api.ollama_routes import after_answer, apply_keep_alive, check_model
from strata.engine.api.request_fields import (
    LLAMA_EMBEDDING_FIELDS,
    OLLAMA_EMBED_FIELDS,
    OLLAMA_EMBEDDINGS_FIELDS,
    OPENAI_EMBEDDING_FIELDS,
    refuse_unknown_fields,
)
from strata.engine.api.textgen import text_assets
from strata.engine.api.validation import read_json_object
from strata.engine.text.embedding_spec import embedding_spec

# Per request, as OpenAI's /v1/embeddings bounds it: inputs, and tokens over all inputs (each
# input is also bounded by the context). Past either: 413 naming the limit.
MAX_EMBED_INPUTS = 2048
MAX_EMBED_TOKENS = 300_000
# With --pooling none every token is a vector of hidden_size floats in the JSON answer.
MAX_TOKEN_VECTORS = 8192

# Ollama options that mean something for an embedding; sampling ones do not.
_OLLAMA_OPTIONS = frozenset({"num_ctx"})


def _inputs(value: Any, name: str) -> list[Any]:
    """A string, a list of token ids (mixed with strings), {"prompt_string"} or {"content":
    [text parts]}, or a list of those (llama_prompts.py): one entry per input."""
    if value is None or value == []:
        raise bad_request(f"'{name}' must be a string, a list of strings, a list of token ids "
                          "or a list of token id lists", param=name)
    items = [value] if is_single_prompt(value) else value
    if len(items) > MAX_EMBED_INPUTS:
        raise ApiError(413, f"'{name}' has {len(items)} inputs; at most {MAX_EMBED_INPUTS} are "
                       "embedded per request: send them in several requests",
                       "request_too_large", param=name)
    for i, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise bad_request(f"'{name}'[{i}] is empty; send some text", param=name)
    return items


async def _token_ids(app: web.Application, assets: Any, items: Sequence[Any],
                     name: str) -> list[list[int]]:
    return await run_cpu(app, _encode_all, assets, items, name)


def _encode_all(assets: Any, items: Sequence[Any], name: str) -> list[list[int]]:
    """Plain strings in one batch (encode_batch releases the GIL), the other forms each."""
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter([assets.encode(text, add_special=True) for text in texts])
    return [next(encoded) if isinstance(item, str) else tokenize_prompt(assets, item, name)
            for item in items]


def _fit(ids: list[list[int]], limit: int, name: str, truncate: bool) -> list[list[int]]:
    """Inputs within `limit` tokens: cut (truncate) or a 400 naming the first that is over."""
    if limit <= 0:
        return ids
    for i, sequence in enumerate(ids):
        if len(sequence) > limit and not truncate:
            raise bad_request(f"'{name}'[{i}] is too large: {len(sequence)} tokens, the "
                              f"context is {limit}; shorten it", code="context_length_exceeded",
                              param=name)
    return [sequence[:limit] for sequence in ids]


def _check_dimensions(body: dict, dimensions: int) -> None:
    """`dimensions`: only the model's own width (its vectors are not trained to be cut)."""
    asked = v.get_int(body, "dimensions", None, minimum=1)
    if asked is not None and dimensions and asked != dimensions:
        raise bad_request(f"'dimensions' {asked} is not supported: this model's embeddings "
                          f"have {dimensions} dimensions; leave it out or send {dimensions}",
                          param="dimensions")


def _pooling(request: web.Request, spec_pooling: str) -> str:
    """The server's --pooling, else the model's own."""
    pooling = request.app[SETTINGS_KEY].embedding_pooling
    return spec_pooling if pooling == "model" else pooling


def refuse_pooling_none(request: web.Request) -> None:
    """A route whose answer has one vector per input: 400 while the server pools none."""
    if request.app[SETTINGS_KEY].embedding_pooling == "none":
        raise bad_request(f"{request.path} answers one vector per input, and this server "
                          "runs with --pooling none (a vector per token); use /embedding, or "
                          "serve with another --pooling", param="input")


async def _embed(request: web.Request, body: dict, items: Sequence[str | list[int]],
                 name: str, *, truncate: bool = False, limit: int | None = None
                 ) -> tuple[list[list[float]], int]:
    """(vectors, tokens run) of the inputs, one vector per input."""
    refuse_pooling_none(request)
    vectors, lengths = await _embed_tokens(request, body, items, name, truncate=truncate,
                                           limit=limit)
    return vectors, sum(lengths)


async def _embed_tokens(request: web.Request, body: dict, items: Sequence[str | list[int]],
                        name: str, *, truncate: bool = False, limit: int | None = None
                        ) -> tuple[list[list[float]], list[int]]:
    """(vectors, each input's tokens): a vector per input, or with --pooling none a vector
    per token of every input, in order."""
    service = service_of(request)
    assets = text_assets(service)
    spec = embedding_spec(assets.source)
    pooling = _pooling(request, spec.pooling)
    _check_dimensions(body, spec.dimensions)
    ids = await _token_ids(request.app, assets, items, name)
    context = service.context_tokens
    limit = min(limit, context) if limit and context else (limit or context)
    ids = _fit(ids, limit, name, truncate)
    num_tokens = sum(map(len, ids))
    max_tokens = MAX_TOKEN_VECTORS if pooling == "none" else MAX_EMBED_TOKENS
    if num_tokens > max_tokens:
        raise ApiError(413, f"'{name}' is {num_tokens} tokens in all; at most "
                       f"{max_tokens} are embedded per request"
                       + (" with --pooling none (a vector each)" if pooling == "none" else "")
                       + ": send them in several requests", "request_too_large", param=name)
    result = await service.embed(ids, pooling)
    return [list(vector) for vector in result.vectors], [len(sequence) for sequence in ids]


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def openai_embeddings(request: web.Request) -> web.Response:
    """POST /v1/embeddings (and /embeddings): input, encoding_format, dimensions."""
    service = service_of(request)
    body = await read_json_object(request)
    refuse_unknown_fields(body, OPENAI_EMBEDDING_FIELDS, "/v1/embeddings")
    refuse_pooling_none(request)
    apply_ttl(service, body)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'",
                          param="encoding_format")
    vectors, num_tokens = await _embed(request, body, _inputs(body.get("input"), "input"),
                                       "input")
    encode = _base64 if encoding == "base64" else (lambda vector: vector)
    return web.json_response({
        "object": "list", "model": service.model_id,
        "data": [{"object": "embedding", "index": i, "embedding": encode(vector)}
                 for i, vector in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _renormalize(vector: list[float], norm: int) -> list[float]:
    """llama.cpp's embd_normalize of an L2-unit vector: every mode but -1 (none) is a scale,
    so it can be applied to the unit vector. 0: max-absolute to int16 range; p: p-norm."""
    if norm == 2:
        return vector
    if norm == 0:
        scale = 32760.0 / (max(abs(x) for x in vector) or 1.0)
    else:
        scale = 1.0 / (sum(abs(x) ** norm for x in vector) ** (1.0 / norm) or 1.0)
    return [x * scale for x in vector]


async def llama_embedding(request: web.Request) -> web.Response:
    """POST /embedding: llama.cpp's own shape, [{"index", "embedding": [vector]}]; with
    --pooling none, "embedding" is every token's vector, not normalized."""
    body = await read_json_object(request)
    refuse_unknown_fields(body, LLAMA_EMBEDDING_FIELDS, request.path)
    name = "content" if body.get("content") is not None else "input"
    norm = v.get_int(body, "embd_normalize", 2, minimum=-1, maximum=64)
    pooling_none = request.app[SETTINGS_KEY].embedding_pooling == "none"
    if norm == -1 and not pooling_none:
        raise bad_request("'embd_normalize' -1 (no normalization) is not supported: Strata's "
                          "pooled vectors are normalized; use 2 (euclidean), 1 or 0",
                          param="embd_normalize")
    if norm != 2 and body.get("embd_normalize") is not None and pooling_none:
        raise bad_request("'embd_normalize' does not apply with --pooling none: the token "
                          "vectors are not normalized; leave it out", param="embd_normalize")
    items = _inputs(body.get(name), name)
    vectors, lengths = await _embed_tokens(request, body, items, name)
    if pooling_none:
        rows, answer = iter(vectors), []
        for i, length in enumerate(lengths):
            answer.append({"index": i, "embedding": [next(rows) for _ in range(length)]})
        return web.json_response(answer)
    return web.json_response([{"index": i, "embedding": [_renormalize(vector, norm)]}
                              for i, vector in enumerate(vectors)])


# Fields of OpenAI's embeddings API that llama.cpp's native one does not have: a body with one
# of them (or `model`, which OpenAI's clients always send) on /embeddings is OpenAI's.
_OPENAI_EMBEDDING_ONLY = (OPENAI_EMBEDDING_FIELDS - LLAMA_EMBEDDING_FIELDS) | {"model"}


async def embeddings(request: web.Request) -> web.Response:
    """POST /embeddings: llama.cpp's native route there, as llama-server has it, unless the
    body is OpenAI's (it names a model or an OpenAI-only field such as encoding_format);
    those are answered as /v1/embeddings, for OpenAI clients given a base URL without /v1."""
    body = await read_json_object(request)
    if any(body.get(field) is not None for field in _OPENAI_EMBEDDING_ONLY):
        return await openai_embeddings(request)
    return await llama_embedding(request)


def _ollama_limit(body: dict) -> int | None:
    options = v.get_object(body, "options")
    unsupported = sorted(set(options) - _OLLAMA_OPTIONS)
    if unsupported:
        raise bad_request(f"options {', '.join(map(repr, unsupported))} do not apply to "
                          "embeddings; only num_ctx does", param="options")
    return v.get_int(options, "num_ctx", None, minimum=1)


async def ollama_embed(request: web.Request) -> web.Response:
    """POST /api/embed: input (string or list), truncate (default true), dimensions."""
    service = service_of(request)
    body = await read_json_object(request)
    refuse_unknown_fields(body, OLLAMA_EMBED_FIELDS, "/api/embed")
    check_model(request, service, body.get("model"))
    keep_alive_s = parse_keep_alive(body.get("keep_alive"))
    limit, truncate = _ollama_limit(body), v.get_bool(body, "truncate", True)
    started_ns = time.monotonic_ns()
    raw = body.get("input")
    apply_keep_alive(service, keep_alive_s)
    if raw in (None, "", []):  # as Ollama: no input only loads the model
        await service.control("load")
        vectors: list[list[float]] = []
        num_tokens = 0
    else:
        vectors, num_tokens = await _embed(request, body, _inputs(raw, "input"), "input",
                                           truncate=truncate, limit=limit)
    await after_answer(service, keep_alive_s)
    return web.json_response({"model": body["model"], "embeddings": vectors,
                              "total_duration": time.monotonic_ns() - started_ns,
                              "load_duration": 0, "prompt_eval_count": num_tokens})


async def ollama_embeddings(request: web.Request) -> web.Response:
    """POST /api/embeddings (Ollama's older route): prompt -> embedding."""
    service = service_of(request)
    body = await read_json_object(request)
    refuse_unknown_fields(body, OLLAMA_EMBEDDINGS_FIELDS, "/api/embeddings")
    check_model(request, service, body.get("model"))
    keep_alive_s = parse_keep_alive(body.get("keep_alive"))
    limit = _ollama_limit(body)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", param="prompt")
    apply_keep_alive(service, keep_alive_s)
    if not prompt:  # as Ollama: an empty prompt only loads the model
        await service.control("load")
        vector: list[float] = []
    else:
        # Ollama's older route truncates to the context, as /api/embed does by default.
        (vector,), _ = await _embed(request, body, [prompt], "prompt", truncate=True,
                                    limit=limit)
    await after_answer(service, keep_alive_s)
    return web.json_response({"embedding": vector})
