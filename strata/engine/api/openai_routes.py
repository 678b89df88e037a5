"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from strata import __version__ as STRATA_VERSION
from strata.engine.api import sse
from strata.engine.api.chat_plan import openai_chat_inputs, plan_chat
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request, error_body
from strata.engine.api.model_list import openai_model_by_name, openai_models
from strata.engine.api.model_routing import apply_ttl, model_pool, service_of
from strata.engine.api.openai_chat import chat_response, chat_stream
from strata.engine.api.openai_logprobs import completion_logprobs, summed_usage
from strata.engine.api.output_format import openai_output_grammar
from strata.engine.api.params import parse_openai, parse_openai_completion
from strata.engine.api.textgen import (
    TextGeneration,
    prompt_token_ids,
    start_text_generation,
    text_assets,
)
from strata.engine.api.validation import get_bool, read_json_object
from strata.engine.protocol import Usage
from strata.engine.service.levels import State

log = logging.getLogger(__name__)
STARTED_AT_S = int(time.time())
# OpenAI's "backend configuration" tag: the server build (seeded outputs may differ across it).
SYSTEM_FINGERPRINT = f"fp_strata_{STRATA_VERSION}"


def model_status(state: str) -> str:
    """The /v1/models status word (loaded | sleeping | unloaded) for a service state."""
    return State(state).model_status


def openai_usage(usage: Usage) -> dict[str, Any]:
    """Usage in OpenAI's shape, cached prompt tokens included."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions: tools, structured output, reasoning, logprobs and n."""
    service = service_of(request)
    body = await read_json_object(request)
    params = parse_openai(body)
    apply_ttl(service, body)
    # Off the loop: a large schema compiles for a second (api/grammar.py).
    inputs, assets = await run_cpu(request.app, openai_chat_inputs, body, service)
    plan = await plan_chat(request.app, assets, inputs)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

    def start(index: int):
        return start_text_generation(service, assets, plan.prompt_ids, params, plan.grammar,
                                     choice=index)

    if params.is_stream:
        if get_bool(body, "verbose"):
            raise bad_request("'verbose' is answered without stream only; leave it out or "
                              "set stream to false", param="verbose")
        return await chat_stream(request, start, plan, params, assets, head, openai_usage)
    return await chat_response(start, plan, params, assets, head, openai_usage,
                               verbose=get_bool(body, "verbose"))


async def chat_input_tokens(request: web.Request) -> web.Response:
    """POST /v1/chat/completions/input_tokens (llama-server's): the prompt's token count for a
    chat completion body (tools and template included), checked as the completion would be."""
    service = service_of(request)
    body = await read_json_object(request)
    parse_openai(body)
    inputs, assets = await run_cpu(request.app, openai_chat_inputs, body, service)
    plan = await plan_chat(request.app, assets, inputs)
    return web.json_response({"input_tokens": len(plan.prompt_ids)})


async def _respond(request: web.Request, assets: Any, prompt_ids: list[int], params: Any,
                   id_prefix: str, kind: str, chunk_kind: str, chunk_choice, final_choice,
                   format_logprobs, grammar: str | None = None) -> web.StreamResponse:
    """The answer of a chat or text completion: an SSE stream of chunks, or one JSON object.

    n > 1 choices run one after another on the same cache slot, so the later ones reuse the
    prompt's K/V (prefilled once) and each draws with its own seed (seed + index)."""
    service = service_of(request)
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

    def start(index: int):
        return start_text_generation(service, assets, prompt_ids, params, grammar,
                                     choice=index)

    def logprobs_of(generation: TextGeneration, text_offset: int = 0) -> dict | None:
        if params.num_logprobs is None:
            return None
        return format_logprobs(assets, generation.take_logprobs(), text_offset)

    first = await start(0)  # fails (as JSON) before any stream header is sent
    if params.is_stream:
        return await _stream(request, first, start, params, head, chunk_kind, chunk_choice,
                             logprobs_of)
    choices, usages = [], []
    for index in range(params.n):
        generation = first if index == 0 else await start(index)
        try:
            text = await generation.collect()
        finally:
            await generation.close()
        choices.append(final_choice(text, generation.finish_reason, index=index,
                                    logprobs=logprobs_of(generation)))
        usages.append(generation.usage)
    return web.json_response({**head, "object": kind, "choices": choices,
                              "usage": openai_usage(summed_usage(usages))})


def _completion_choice(text: str | None, finish_reason: str | None, *, is_first: bool = True,
                       index: int = 0, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text or "", "logprobs": logprobs,
            "finish_reason": finish_reason}


async def _stream(request: web.Request, first: TextGeneration, start, params: Any, head: dict,
                  kind: str, choice, logprobs_of) -> web.StreamResponse:
    """Stream each choice's chunks (tagged with its index), then usage and [DONE]; a failure
    after the headers ends with an error event."""
    response = await sse.open_stream(request)
    head = {**head, "object": kind}
    generation = first
    usages = []
    try:
        for index in range(params.n):
            if index > 0:
                generation = await start(index)
            await _stream_choice(response, generation, head, kind, choice, index, logprobs_of)
            usages.append(generation.usage)
        await end_stream(response, head, usages if params.include_usage else None,
                         openai_usage)
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except Exception as exc:  # noqa: BLE001 - logged there; the stream must end with an event
        await send_stream_error(request, response, exc)
    finally:
        await generation.close()
    return response


async def _stream_choice(response: web.StreamResponse, generation: TextGeneration, head: dict,
                         kind: str, choice, index: int, logprobs_of) -> None:
    """One text completion choice's chunks: its text deltas, then its finish reason."""
    text_offset = 0
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for text in deltas:
            await sse.send_data(response, {**head, "choices": [choice(
                text, None, is_first=False, index=index,
                logprobs=logprobs_of(generation, text_offset))]})
            text_offset += len(text)
    final = choice(None, generation.finish_reason, is_first=False, index=index,
                   logprobs=logprobs_of(generation, text_offset))
    await sse.send_data(response, {**head, "choices": [final]})


async def end_stream(response: web.StreamResponse, head: dict, usages: list | None,
                     usage) -> None:
    """The end of an OpenAI stream: the usage chunk of all choices (when asked), then [DONE]."""
    if usages is not None:
        await sse.send_data(response, {**head, "choices": [],
                                       "usage": usage(summed_usage(usages))})
    await sse.send_data(response, "[DONE]")


async def send_stream_error(request: web.Request, response: web.StreamResponse,
                             exc: Exception) -> None:
    if not isinstance(exc, ApiError):
        log.error("stream %s failed", request.path, exc_info=exc)
        exc = ApiError(500, "internal server error; the details are in the server log",
                       "internal")
    with contextlib.suppress(ConnectionError):
        await sse.send_data(response, error_body(exc, anthropic=False))
        await sse.send_data(response, "[DONE]")


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    service = service_of(request)
    body = await read_json_object(request)
    params = parse_openai_completion(body)
    apply_ttl(service, body)
    if body.get("echo") not in (None, False) or body.get("suffix") is not None:
        raise bad_request("'echo' and 'suffix' are not supported; leave them out")
    assets = text_assets(service)
    prompt_ids = await prompt_token_ids(request.app, assets, body.get("prompt"))
    return await _respond(request, assets, prompt_ids, params, "cmpl", "text_completion",
                          "text_completion", _completion_choice, _completion_choice,
                          completion_logprobs,
                          await run_cpu(request.app, openai_output_grammar, body))


def _model_object(request: web.Request) -> dict[str, Any]:
    service = service_of(request)
    state = State(service.status()["state"])
    return {"id": service.model_id, "object": "model", "created": STARTED_AT_S,
            "owned_by": "strata", "status": model_status(state),
            "context_tokens": service.context_tokens}


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: every model of the library and its state (model_list.py)."""
    pool = model_pool(request.app)
    if pool is not None:
        return web.json_response(openai_models(pool, STARTED_AT_S))
    return web.json_response({"object": "list", "data": [_model_object(request)]})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: by any name the model answers to."""
    pool = model_pool(request.app)
    if pool is not None:
        return web.json_response(openai_model_by_name(pool, request.match_info["model"],
                                                      STARTED_AT_S))
    model = _model_object(request)
    if request.match_info["model"] != model["id"]:
        raise ApiError(404, f"model {request.match_info['model']!r} is not served here; "
                       f"this server runs {model['id']!r}", "model_not_found")
    return web.json_response(model)
