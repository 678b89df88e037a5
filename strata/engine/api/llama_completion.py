"""llama.cpp's native POST /completion: `n_predict`, its sampling names, `n_probs`.

The request fields are llama.cpp server's (tools/server/README.md); the ones listed in
COMPLETION_FIELDS are honoured, any other is a 400 naming it. The answer has llama.cpp's
shape: `content`, `stop`, `stop_type`, `tokens_predicted`, `tokens_evaluated`,
`tokens_cached` and, with n_probs, `completion_probabilities`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api import validation as v
from strata.engine.api.errors import ApiError, bad_request, error_body
from strata.engine.api.model_routing import service_of
from strata.engine.api.params import GenerationParams
from strata.engine.api.request_fields import refuse_unknown_fields
from strata.engine.api.sampling_params import MAX_TOP_LOGPROBS, parse_penalties
from strata.engine.api.textgen import (
    TextGeneration,
    ended_usage,
    prompt_token_ids,
    start_text_generation,
    text_assets,
)
from strata.engine.protocol import TokenLogprob
from strata.engine.text.token_bytes import token_bytes

log = logging.getLogger(__name__)

COMPLETION_FIELDS = frozenset({
    "prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
    "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop", "stream",
    "n_probs", "id_slot", "cache_prompt", "logit_bias", "model",
})


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """llama.cpp's logit_bias: [[id, bias], ...] or {"id": bias}; a bias of false bans."""
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
        if isinstance(token, str):
            token = v.parse_id_string(token)
        if (isinstance(token, bool) or not isinstance(token, int)
                or not 0 <= token <= v.MAX_INT_FIELD):
            raise bad_request(f"'logit_bias' token {token!r:.20} is not a token id",
                              param="logit_bias")
        amount = -100.0 if amount is False else amount
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or not -100 <= amount <= 100:
            raise bad_request(f"'logit_bias' for token {token} must be a number in -100..100 "
                              "or false", param="logit_bias")
        bias.append((token, float(amount)))
    return tuple(bias)


def parse_completion(body: dict, fields: frozenset[str] = COMPLETION_FIELDS,
                     route: str = "/completion") -> GenerationParams:
    """The fields of llama.cpp's /completion as GenerationParams (n_predict is max_tokens)."""
    refuse_unknown_fields(body, fields, route)
    if body.get("cache_prompt") is False:
        raise bad_request("'cache_prompt': false is not supported; Strata always reuses the "
                          "slot's cached prefix", param="cache_prompt")
    n_predict = v.get_int(body, "n_predict", -1, minimum=-1)
    if n_predict == 0:
        raise bad_request("'n_predict' is 0, which generates nothing; use -1 (until the end) "
                          "or a number of tokens, or /tokenize to count a prompt",
                          param="n_predict")
    seed = v.get_int(body, "seed", -1)
    slot = v.get_int(body, "id_slot", -1, minimum=-1)  # -1: any slot (the engine picks)
    return GenerationParams(
        max_tokens=None if n_predict == -1 else n_predict,
        temperature=v.get_temperature(body, maximum=2.0), top_p=v.get_top_p(body),
        top_k=v.get_top_k(body), min_p=v.get_min_p(body),
        seed=None if seed == -1 else v.get_seed(body), stops=v.get_stop_strings(body, "stop"),
        is_stream=v.get_bool(body, "stream"), include_usage=False,
        slot=None if slot == -1 else slot, slot_param="id_slot",
        penalties=parse_penalties(body), logit_bias=_logit_bias(body),
        num_logprobs=v.get_int(body, "n_probs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS) or None)


def completion_probabilities(assets: Any, records: Sequence[TokenLogprob]) -> list[dict]:
    """llama.cpp's completion_probabilities entries: id, token, bytes, logprob, top_logprobs."""
    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(assets, token_id)
        return {"id": token_id, "token": raw.decode("utf-8", errors="replace"),
                "bytes": list(raw), "logprob": logprob}

    return [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(i, lp) for i, lp in r.top]}
            for r in records]


def _final(generation: TextGeneration, params: GenerationParams, model: str) -> dict:
    usage = ended_usage(generation)
    stop_type = ("word" if generation.stop_sequence is not None
                 else "limit" if generation.finish_reason == "length" else "eos")
    return {"stop": True, "model": model, "id_slot": _slot(generation, params),
            "stop_type": stop_type,
            "stopping_word": generation.stop_sequence or "",
            "tokens_predicted": usage.completion_tokens, "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens, "truncated": False}


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
        assets, generation.take_logprobs())}


async def completion(request: web.Request) -> web.StreamResponse:
    """POST /completion (llama.cpp's native text completion)."""
    service = service_of(request)
    body = await v.read_json_object(request)
    params = parse_completion(body)
    assets = text_assets(service)
    prompt_ids = await prompt_token_ids(request.app, assets, body.get("prompt"))
    return await answer_completion(request, assets, prompt_ids, params)


async def answer_completion(request: web.Request, assets: Any, prompt_ids: list[int],
                            params: GenerationParams) -> web.StreamResponse:
    """Generate from prompt_ids and answer in /completion's shape (also /infill's)."""
    service = service_of(request)
    generation = await start_text_generation(service, assets, prompt_ids, params)
    if not params.is_stream:
        try:
            text = await generation.collect()
        finally:
            await generation.close()
        return web.json_response({"content": text, **_final(generation, params, service.model_id),
                                  **_probabilities(generation, params, assets)})
    response = await sse.open_stream(request)
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for text in deltas:
                await sse.send_data(response, {"content": text, "stop": False,
                                               "id_slot": _slot(generation, params),
                                               **_probabilities(generation, params, assets)})
        await sse.send_data(response, {"content": "", **_final(generation, params,
                                                                service.model_id),
                                       **_probabilities(generation, params, assets)})
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
