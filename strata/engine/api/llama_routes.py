"""llama.cpp-server-style routes: /health, /props, /metrics, /slots, /tokenize, /detokenize,
/v1/status. The status routes only read service.status(): they never wake the model or reset
an idle timer.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from strata.engine.api.errors import bad_request
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.metrics import CONTENT_TYPE, render_metrics
from strata.engine.api.textgen import text_assets
from strata.engine.api.validation import NUM_CACHE_SLOTS, get_bool, read_json_object
from strata.units import MIB

_HEALTH = {"loading": ("loading", 503), "starting": ("loading", 503),
           "failed": ("error", 503)}


def _status(request: web.Request) -> dict[str, Any]:
    return dict(request.app[SERVICE_KEY].status())


async def health(request: web.Request) -> web.Response:
    """GET /health: ok while the server can answer (loaded, sleeping or unloaded-on-demand),
    with the state and the memory held in MiB: `vram_mib` on a GPU, `ram_mib` on the CPU."""
    status = _status(request)
    state = str(status.get("state", "unloaded"))
    word, http_status = _HEALTH.get(state, ("ok", 200))
    body: dict[str, Any] = {"status": word, "state": state}
    vram = status.get("vram")
    if isinstance(vram, dict):
        held_bytes = sum(int((a or {}).get("resident_bytes") or 0) for a in vram.values())
        body[f"{str(status['memory_kind']).lower()}_mib"] = round(held_bytes / MIB, 1)
    return web.json_response(body, status=http_status)


async def props(request: web.Request) -> web.Response:
    """GET /props: context size, model path, chat template, whether the model sleeps."""
    service = request.app[SERVICE_KEY]
    status = _status(request)
    assets = text_assets(service)
    n_ctx = service.context_tokens
    return web.json_response({
        "n_ctx": n_ctx, "default_generation_settings": {"n_ctx": n_ctx},
        "total_slots": NUM_CACHE_SLOTS,
        "model_path": str(status.get("model_path") or status.get("model") or service.model_id),
        "model_alias": service.model_id, "chat_template": assets.chat_template or "",
        "is_sleeping": status.get("state") == "sleeping", "state": status.get("state")})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text."""
    return web.Response(body=render_metrics(_status(request)).encode(),
                        headers={"Content-Type": CONTENT_TYPE})


async def v1_status(request: web.Request) -> web.Response:
    """GET /v1/status: the service's whole status snapshot."""
    return web.json_response(_status(request), dumps=_dumps)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)  # paths and enums in the status become strings


async def slots(request: web.Request) -> web.Response:
    """GET /slots: the cache slots as the service reports them (one entry per slot)."""
    service = request.app[SERVICE_KEY]
    reported = _status(request).get("slots")
    if isinstance(reported, list):
        return web.json_response(reported, dumps=_dumps)
    return web.json_response([{"id": i, "n_ctx": service.context_tokens}
                              for i in range(NUM_CACHE_SLOTS)])


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize {"content", "add_special", "with_pieces"} -> {"tokens"}."""
    body = await read_json_object(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request("'content' must be a string", param="content")
    add_special = get_bool(body, "add_special", False)
    assets = text_assets(request.app[SERVICE_KEY])
    ids = list(assets.encode(content, add_special=add_special))
    if get_bool(body, "with_pieces", False):
        return web.json_response({"tokens": [
            {"id": i, "piece": assets.decode([i])} for i in ids]})
    return web.json_response({"tokens": ids})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize {"tokens"} -> {"content"}."""
    body = await read_json_object(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of integer token ids", param="tokens")
    assets = text_assets(request.app[SERVICE_KEY])
    bad = [t for t in tokens if not 0 <= t < assets.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary 0..{assets.vocab_size - 1}",
                          param="tokens")
    return web.json_response({"content": assets.decode(tokens)})
