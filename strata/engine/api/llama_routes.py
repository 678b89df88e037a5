"""llama.cpp-server-style routes: /health, /props, /metrics, /slots, /tokenize, /detokenize,
/v1/status. The status routes only read service.status(): they never wake the model or reset
an idle timer.
"""

from __future__ import annotations

import json
from typing import Any

import psutil
from aiohttp import web

from strata import __version__ as STRATA_VERSION
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import SETTINGS_KEY
from strata.engine.api.metrics import CONTENT_TYPE, render_metrics
from strata.engine.api.model_routing import service_of
from strata.engine.api.redact import file_name, redact
from strata.engine.api.textgen import text_assets
from strata.engine.api.validation import get_bool, read_json_object
from strata.engine.service.levels import State, resident_bytes
from strata.engine.text.token_bytes import token_piece
from strata.units import MIB

# When this server process started (seconds since the epoch), as llama-server reports it.
PROCESS_START_S = int(psutil.Process().create_time())
_DUMP_SLICE = 65536  # token ids per json.dumps call when writing a /tokenize answer


def _check_endpoint(request: web.Request, name: str) -> None:
    """501 when the server was started with this endpoint off (--no-NAME-endpoint)."""
    if not getattr(request.app[SETTINGS_KEY], f"{name}_endpoint"):
        raise ApiError(501, f"this server does not serve /{name}; start it without "
                       f"--no-{name}-endpoint", "not_supported")


def _status(request: web.Request) -> dict[str, Any]:
    return dict(service_of(request).status())


async def health(request: web.Request) -> web.Response:
    """GET /health: ok while the server can answer (loaded, sleeping or unloaded-on-demand),
    with the state and the memory held in MiB: `vram_mib` on a GPU, `ram_mib` on the CPU."""
    status = _status(request)
    state = State(status["state"])
    word, http_status = state.health
    body: dict[str, Any] = {"status": word, "state": state}
    held_bytes = resident_bytes(status["vram"])
    body[f"{str(status['memory_kind']).lower()}_mib"] = round(held_bytes / MIB, 1)
    return web.json_response(body, status=http_status)


async def props(request: web.Request) -> web.Response:
    """GET /props: context size, model file name, chat template, whether the model sleeps,
    and the sampling defaults with where each comes from (settings, the model, llama.cpp)."""
    service = service_of(request)
    status = _status(request)
    assets = text_assets(service)
    n_ctx = service.context_tokens
    defaults = service.sampling_defaults
    return web.json_response({
        "n_ctx": n_ctx, "default_generation_settings": {
            "n_ctx": n_ctx, "params": defaults.params(), "sources": dict(defaults.sources)},
        "total_slots": service.num_slots, "build_info": f"strata {STRATA_VERSION}",
        "modalities": {"vision": False, "audio": False},  # text in, text out
        # llama.cpp's field, but the file name only: where the server keeps it is its own.
        "model_path": file_name(str(status.get("model_path") or status.get("model")
                                    or service.model_id)),
        "model_alias": service.model_id, "chat_template": assets.chat_template or "",
        "is_sleeping": status.get("state") == "sleeping", "state": status.get("state")})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text, with llama-server's Process-Start-Time-Unix header. A
    scrape starts a new window for the throughput gauges (llama-server's behaviour)."""
    _check_endpoint(request, "metrics")
    service = service_of(request)
    counters = getattr(service, "metrics", None)
    rates = counters.take_rates() if counters is not None else (0.0, 0.0)
    forwards = await service.forward_counts()  # asks the engine; wakes nothing
    return web.Response(body=render_metrics(_status(request), rates, forwards).encode(),
                        headers={"Content-Type": CONTENT_TYPE,
                                 "Process-Start-Time-Unix": str(PROCESS_START_S)})


async def v1_status(request: web.Request) -> web.Response:
    """GET /v1/status: the service's whole status snapshot, server paths as file names."""
    return web.json_response(redact(_status(request)), dumps=_dumps)


def _dumps(value: Any) -> str:
    # Enums (and any path redact() did not see) become strings, paths as file names.
    return json.dumps(value, default=lambda v: redact(str(v)))


async def slots(request: web.Request) -> web.Response:
    """GET /slots: the cache slots as the service reports them (one entry per slot)."""
    _check_endpoint(request, "slots")
    service = service_of(request)
    reported = _status(request).get("slots")
    if isinstance(reported, list):
        return web.json_response(redact(reported), dumps=_dumps)
    return web.json_response([{"id": i, "n_ctx": service.context_tokens}
                              for i in range(service.num_slots)])


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize {"content", "add_special", "with_pieces"} -> {"tokens"}."""
    body = await read_json_object(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request("'content' must be a string", param="content")
    add_special = get_bool(body, "add_special", False)
    with_pieces = get_bool(body, "with_pieces", False)
    assets = text_assets(service_of(request))
    # Tokenizing and writing out a few MiB of text takes seconds: not on the event loop.
    body_bytes = await run_cpu(request.app, _tokenize_body, assets, content, add_special,
                               with_pieces)
    return web.Response(body=body_bytes, content_type="application/json")


def _tokenize_body(assets: Any, content: str, add_special: bool, with_pieces: bool) -> bytes:
    ids = assets.encode(content, add_special=add_special)
    if with_pieces:
        # A piece that is half a UTF-8 character is its byte values, as llama.cpp sends it.
        tokens: list[Any] = [{"id": i, "piece": token_piece(assets, i)} for i in ids]
    else:
        tokens = ids
    # In slices: one json.dumps of millions of ids would hold the GIL (and the loop) for long.
    parts = [json.dumps(tokens[i:i + _DUMP_SLICE])[1:-1]
             for i in range(0, len(tokens), _DUMP_SLICE)]
    return ('{"tokens": [' + ", ".join(p for p in parts if p) + "]}").encode()


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize {"tokens"} -> {"content"}."""
    body = await read_json_object(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of integer token ids", param="tokens")
    assets = text_assets(service_of(request))
    bad = [t for t in tokens if not 0 <= t < assets.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary 0..{assets.vocab_size - 1}",
                          param="tokens")
    return web.json_response({"content": await run_cpu(request.app, assets.decode, tokens)})
