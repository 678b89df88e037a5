"""llama.cpp's native POST /completion: `n_predict`, its sampling names, `n_probs`.

The request fields are llama.cpp server's (tools/server/README.md); the ones listed in
COMPLETION_FIELDS are honoured, any other is a 400 naming it. The answer has llama.cpp's
shape: `content`, `tokens`, `stop`, `stop_type`, `tokens_predicted`, `tokens_evaluated`,
`tokens_cached`, `generation_settings`, `prompt`, `has_new_line`, `timings` and, with n_probs,
`completion_probabilities` (llama_answer.py); the prompt forms are llama_prompts.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from strata.engine.api import openai_routes, sse
from strata.engine.api import validation as v
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request, error_body
from strata.engine.api.llama_answer import (
    AnswerOptions,
    generation_settings,
    only_fields,
    parse_answer_options,
    progress_json,
    running_timings,
    timings,
)
from strata.engine.api.llama_prompts import llama_prompts
from strata.engine.api.model_routing import service_of
from strata.engine.api.params import GenerationParams
from strata.engine.api.request_fields import OPENAI_COMPLETION_FIELDS, refuse_unknown_fields
from strata.engine.api.sampling_params import MAX_TOP_LOGPROBS, parse_penalties
from strata.engine.api.textgen import (
    TextGeneration,
    ended_usage,
    start_text_generation,
    text_assets,
)
from strata.engine.protocol import PromptProgress, TokenLogprob
from strata.engine.text.token_bytes import token_bytes

log = logging.getLogger(__name__)
NO_OPTIONS = AnswerOptions()

COMPLETION_FIELDS = frozenset({
    "prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "n_probs", "id_slot", "cache_prompt", "logit_bias", "model", "return_tokens",
    "response_fields", "ignore_eos", "return_progress", "timings_per_token",
    "post_sampling_probs",
})


def _logit_bias(body: dict, encode: Callable[[str], list[int]] | None
                ) -> tuple[tuple[int, float], ...]:
    """llama.cpp's logit_bias: [[id, bias], ...] or {"id": bias}; a bias of false bans. With
    encode, a key that is text (not digits) biases each of its tokens, as llama.cpp does."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, list):
        raise bad_request("'logit_bias' must be [[token id, bias], ...] or an object",
                          param="logit_bias")
    bias = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad_request("'logit_bias' entries must be [token id, bias]", param="logit_bias")
        token, amount = pair
        tokens = [token]
        if isinstance(token, str):
            is_digits = token.isascii() and token.isdigit()  # an id, perhaps out of range
            tokens = [v.parse_id_string(token)] if is_digits or encode is None \
                else encode(token)
        if not tokens or any(isinstance(t, bool) or not isinstance(t, int)
                             or not 0 <= t <= v.MAX_INT_FIELD for t in tokens):
            raise bad_request(f"'logit_bias' token {token!r:.20} is not a token id"
                              + (" or a text" if encode is not None else ""),
                              param="logit_bias")
        amount = -100.0 if amount is False else amount
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or not -100 <= amount <= 100:
            raise bad_request(f"'logit_bias' for token {token!r:.20} must be a number in "
                              "-100..100 or false", param="logit_bias")
        bias += [(t, float(amount)) for t in tokens]
    return tuple(bias)


def parse_completion(body: dict, fields: frozenset[str] = COMPLETION_FIELDS,
                     route: str = "/completion",
                     encode: Callable[[str], list[int]] | None = None) -> GenerationParams:
    """The fields of llama.cpp's /completion as GenerationParams (n_predict is max_tokens);
    encode tokenizes logit_bias keys that are text."""
    refuse_unknown_fields(body, fields, route)
    n_predict = v.get_int(body, "n_predict", -1, minimum=-1)
    if n_predict == 0:
        raise bad_request("'n_predict' is 0, which generates nothing; use -1 (until the end) "
                          "or a number of tokens, or /tokenize to count a prompt",
                          param="n_predict")
    seed = v.get_int(body, "seed", -1)
    slot = v.get_int(body, "id_slot", -1, minimum=-1)  # -1: any slot (the engine picks)
    num_logprobs = v.get_int(body, "n_probs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS) or None
    post_sampling_probs = v.get_bool(body, "post_sampling_probs")
    if post_sampling_probs and num_logprobs is None:
        raise bad_request("'post_sampling_probs' gives the n_probs records as the sampler's "
                          "probabilities; set 'n_probs' too, or leave it out",
                          param="post_sampling_probs")
    return GenerationParams(
        max_tokens=None if n_predict == -1 else n_predict,
        temperature=v.get_temperature(body, maximum=2.0), top_p=v.get_top_p(body),
        top_k=v.get_top_k(body), min_p=v.get_min_p(body),
        seed=None if seed == -1 else v.get_seed(body), stops=v.get_stop_strings(body, "stop"),
        is_stream=v.get_bool(body, "stream"), include_usage=False,
        slot=None if slot == -1 else slot, slot_param="id_slot",
        penalties=parse_penalties(body), logit_bias=_logit_bias(body, encode),
        num_logprobs=num_logprobs, post_sampling_probs=post_sampling_probs,
        reuse_cache=v.get_bool(body, "cache_prompt", True),
        ignore_eos=v.get_bool(body, "ignore_eos"))


def completion_probabilities(assets: Any, records: Sequence[TokenLogprob],
                             post_sampling: bool = False) -> list[dict]:
    """llama.cpp's completion_probabilities entries: id, token, bytes, logprob, top_logprobs;
    post_sampling: prob and top_probs (the sampler's probabilities, post_sampling_probs)."""
    value, top = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(assets, token_id)
        return {"id": token_id, "token": raw.decode("utf-8", errors="replace"),
                "bytes": list(raw), value: math.exp(logprob) if post_sampling else logprob}

    return [{**entry(r.token_id, r.logprob), top: [entry(i, lp) for i, lp in r.top]}
            for r in records]


def _final(generation: TextGeneration, params: GenerationParams, model: str,
           content: str, prompt: str, options: AnswerOptions, has_new_line: bool) -> dict:
    usage = ended_usage(generation)
    stop_type = ("word" if generation.stop_sequence is not None
                 else "limit" if generation.finish_reason == "length" else "eos")
    id_slot = _slot(generation, params)
    return {"content": content, "tokens": _generated_ids(generation) if options.return_tokens
            else [], "id_slot": id_slot, "stop": True, "model": model,
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "generation_settings": generation_settings(generation.sampling, params, id_slot),
            "prompt": prompt, "has_new_line": has_new_line, "truncated": False,
            "stop_type": stop_type, "stopping_word": generation.stop_sequence or "",
            "tokens_cached": usage.cached_tokens, "timings": timings(usage)}


def _generated_ids(generation: TextGeneration, start: int = 0) -> list[int]:
    """The generated token ids from `start`, end-of-sequence tokens left out (they make no
    text)."""
    silent = generation.sampling.stop_token_ids if generation.sampling is not None else ()
    return [t for t in generation.token_ids[start:] if t not in silent]


def _slot(generation: TextGeneration, params: GenerationParams) -> int:
    """The slot the engine used (llama.cpp answers it), else the one asked, else -1."""
    for slot in (generation.slot, params.slot):
        if slot is not None:
            return slot
    return -1


def _probabilities(generation: TextGeneration, params: GenerationParams, assets: Any) -> dict:
    if params.num_logprobs is None:
        return {}
    return {"completion_probabilities": completion_probabilities(
        assets, generation.take_logprobs(), params.post_sampling_probs)}


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /completion (llama.cpp's native text completion); a batch of prompts is answered
    with a list, one answer per prompt in order."""
    service = service_of(request)
    body = await v.read_json_object(request)
    assets = text_assets(service)
    params = parse_completion(body, encode=lambda text: assets.encode(text, add_special=False))
    options = parse_answer_options(body)
    prompts, is_batch = await llama_prompts(request.app, assets, body.get("prompt"))
    if not is_batch:
        return await answer_completion(request, assets, prompts[0], params, options)
    if params.is_stream:
        raise bad_request("streaming several prompts is not supported; send one prompt per "
                          "request, or leave 'stream' out", param="stream")
    async with asyncio.TaskGroup() as group:  # one fails: the rest are cancelled
        tasks = [group.create_task(_answer_one(request.app, service, assets, ids, params,
                                               options, i))
                 for i, ids in enumerate(prompts)]
    return web.json_response([task.result() for task in tasks])


# Fields of OpenAI's completions API that llama.cpp's /completion does not have: a body with
# one of them (or with `model`, which OpenAI requires) on /completions is OpenAI's.
_OPENAI_ONLY_FIELDS = (OPENAI_COMPLETION_FIELDS - COMPLETION_FIELDS) | {"model"}


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /completions: llama.cpp's native route there, as llama-server has it, unless the
    body is OpenAI's (it names a model or an OpenAI-only field such as max_tokens); those
    are answered as /v1/completions, for OpenAI clients given a base URL without /v1."""
    body = await v.read_json_object(request)
    if any(body.get(name) is not None for name in _OPENAI_ONLY_FIELDS):
        return await openai_routes.completions(request)
    return await completion(request)


async def _answer_one(app: web.Application, service: Any, assets: Any, prompt_ids: list[int],
                      params: GenerationParams, options: AnswerOptions, index: int) -> dict:
    generation = await start_text_generation(service, assets, prompt_ids, params)
    try:
        text = await generation.collect()
    finally:
        await generation.close()
    prompt = await run_cpu(app, assets.decode, prompt_ids, False)
    answer = {"index": index, **_final(generation, params, service.model_id, text, prompt,
                                       options, "\n" in text),
              **_probabilities(generation, params, assets)}
    return only_fields(answer, options.response_fields)


async def answer_completion(request: web.Request, assets: Any, prompt_ids: list[int],
                            params: GenerationParams,
                            options: AnswerOptions = NO_OPTIONS) -> web.StreamResponse:
    """Generate from prompt_ids and answer in /completion's shape (also /infill's)."""
    service = service_of(request)
    if not params.is_stream:
        answer = await _answer_one(request.app, service, assets, prompt_ids, params, options,
                                   0)
        return web.json_response(answer)
    # The engine's prompt reports also give the per-token timings their prompt figures.
    params = dataclasses.replace(
        params, return_progress=options.return_progress or options.timings_per_token)
    generation = await start_text_generation(service, assets, prompt_ids, params)
    response = await sse.open_stream(request)
    try:
        num_sent_ids, has_new_line = 0, False
        progress: PromptProgress | None = None
        first_token_s: float | None = None
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for piece in pieces:
                chunk = {"index": 0, "content": "", "tokens": [], "stop": False,
                         "id_slot": _slot(generation, params),
                         "tokens_predicted": len(generation.token_ids),
                         "tokens_evaluated": len(prompt_ids)}
                if isinstance(piece, PromptProgress):
                    progress = piece
                    if not options.return_progress:
                        continue
                    chunk["prompt_progress"] = progress_json(piece)
                else:
                    first_token_s = first_token_s or time.monotonic()
                    chunk["content"] = piece
                    chunk["tokens"] = _generated_ids(generation, num_sent_ids)
                    num_sent_ids = len(generation.token_ids)
                    has_new_line = has_new_line or "\n" in piece
                    chunk |= _probabilities(generation, params, assets)
                if options.timings_per_token:
                    decode_s = time.monotonic() - first_token_s if first_token_s else 0.0
                    chunk["timings"] = running_timings(progress, len(generation.token_ids),
                                                       decode_s)
                await sse.send_data(response, chunk)
        prompt = await run_cpu(request.app, assets.decode, prompt_ids, False)
        final = {"index": 0, **_final(generation, params, service.model_id, "", prompt, options,
                                      has_new_line),
                 **_probabilities(generation, params, assets)}
        await sse.send_data(response, only_fields(final, options.response_fields))
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except Exception as exc:  # the stream must end with an error event
        if not isinstance(exc, ApiError):
            log.error("stream %s failed", request.path, exc_info=exc)
            exc = ApiError(500, "internal server error; the details are in the server log",
                           "internal")
        with contextlib.suppress(ConnectionError):
            await sse.send_data(response, error_body(exc, anthropic=False))
    finally:
        await generation.close()
    return response
