"""Ollama-compatible routes, so apps that only know Ollama's API find and use Strata.

/api/version, /api/tags, /api/show, /api/ps, /api/chat and /api/generate. Streaming answers
are NDJSON (one JSON object a line), as Ollama sends them; errors are `{"error": "..."}`.
`keep_alive` maps onto Strata's unload idle timer (docs/api.md, "Ollama API").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from strata import __version__ as STRATA_VERSION
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.ollama_params import OllamaRequest, parse_ollama, parse_ollama_messages
from strata.engine.api.openai_routes import model_status
from strata.engine.api.textgen import (
    TextGeneration,
    check_fits_context,
    encode_chat,
    start_text_generation,
    text_assets,
)
from strata.engine.api.validation import read_json_object
from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import resident_bytes

log = logging.getLogger(__name__)
# The Ollama API level these routes follow; apps compare it against their minimum.
OLLAMA_API_VERSION = "0.12.0"
_TAG = ":latest"


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _served_name(service: Any) -> str:
    return f"{service.model_id}{_TAG}"


def check_model(service: Any, name: Any) -> None:
    """404 in Ollama's words unless `name` is the served model (with or without ':latest')."""
    if name not in (service.model_id, _served_name(service)):
        raise ApiError(404, f"model '{name}' not found; this server runs "
                       f"'{_served_name(service)}' (GET /api/tags)", "model_not_found")


@functools.lru_cache(maxsize=4)
def _model_facts(path: str) -> dict[str, Any]:
    """Format, family, size and quantization of the model file, read from its header only."""
    from strata.engine.core.loader import inspect_model  # host-safe: reads no tensor
    from strata.engine.core.model_config import ModelFormatError

    size_bytes = _dir_bytes(Path(path))
    try:
        info = inspect_model(Path(path))
    except ModelFormatError as exc:  # a listing must not fail; the load will say why
        log.info("model details unavailable: %s", exc)
        facts = {"format": "gguf" if path.endswith(".gguf") else "hf", "family": "unknown",
                 "parameter_count": 0, "quantization_level": ""}
    else:
        quant = max(info.quant_types, key=info.quant_types.get) if info.quant_types else ""
        facts = {"format": info.format, "family": info.model_type,
                 "parameter_count": info.parameter_count, "quantization_level": quant}
    return {**facts, "size": size_bytes,
            "digest": hashlib.sha256(f"{path}:{size_bytes}".encode()).hexdigest(),
            "modified_at": dt.datetime.fromtimestamp(Path(path).stat().st_mtime, dt.UTC)
            .isoformat().replace("+00:00", "Z")}


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _human_parameters(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


async def _facts(service: Any) -> dict[str, Any]:
    path = text_assets(service).source  # the model file or directory the tokenizer came from
    return await asyncio.to_thread(_model_facts, path)


def _details(facts: dict[str, Any]) -> dict[str, Any]:
    return {"parent_model": "", "format": facts["format"], "family": facts["family"],
            "families": [facts["family"]],
            "parameter_size": _human_parameters(facts["parameter_count"]),
            "quantization_level": facts["quantization_level"]}


async def version(request: web.Request) -> web.Response:
    """GET /api/version."""
    return web.json_response({"version": OLLAMA_API_VERSION, "strata": STRATA_VERSION})


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: the models this server can run."""
    service = request.app[SERVICE_KEY]
    facts = await _facts(service)
    name = _served_name(service)
    return web.json_response({"models": [{
        "name": name, "model": name, "modified_at": facts["modified_at"],
        "size": facts["size"], "digest": facts["digest"], "details": _details(facts)}]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the model while it holds memory (loaded or sleeping), with its VRAM."""
    service = request.app[SERVICE_KEY]
    status = service.status()
    if model_status(str(status.get("state", "unloaded"))) == "unloaded":
        return web.json_response({"models": []})
    facts = await _facts(service)
    size_vram = resident_bytes(status.get("vram") or {})
    countdown_s = (status.get("idle") or {}).get("unload")
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=countdown_s)
               if countdown_s is not None else dt.datetime(2318, 1, 1, tzinfo=dt.UTC))
    name = _served_name(service)
    return web.json_response({"models": [{
        "name": name, "model": name, "size": facts["size"], "digest": facts["digest"],
        "details": _details(facts), "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "size_vram": size_vram, "context_length": service.context_tokens}]})


async def show(request: web.Request) -> web.Response:
    """POST /api/show: details, chat template and capabilities of the model."""
    service = request.app[SERVICE_KEY]
    body = await read_json_object(request)
    check_model(service, body.get("model", body.get("name")))
    facts = await _facts(service)
    assets = text_assets(service)
    family = facts["family"]
    return web.json_response({
        "license": "", "modelfile": f"# served by Strata\nFROM {_served_name(service)}\n",
        "parameters": "", "template": assets.chat_template or "",
        "details": _details(facts), "modified_at": facts["modified_at"],
        "model_info": {"general.architecture": family,
                       "general.parameter_count": facts["parameter_count"],
                       f"{family}.context_length": service.context_tokens},
        "capabilities": ["completion"]})


async def chat(request: web.Request) -> web.StreamResponse:
    """POST /api/chat."""
    service = request.app[SERVICE_KEY]
    body = await read_json_object(request)
    parsed = parse_ollama(body)
    check_model(service, parsed.model)
    messages = parse_ollama_messages(body)
    assets = text_assets(service)
    prompt_ids = await encode_chat(request.app, assets, messages)
    return await _answer(request, parsed, prompt_ids, assets, "message")


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /api/generate; an empty prompt only loads (or, with keep_alive 0, unloads)."""
    service = request.app[SERVICE_KEY]
    body = await read_json_object(request)
    parsed = parse_ollama(body, refuse=("suffix", "template", "context"))
    check_model(service, parsed.model)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", param="prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad_request("'system' must be a string", param="system")
    if not prompt:
        return await _load_or_unload(service, parsed)
    assets = text_assets(service)
    if body.get("raw"):
        prompt_ids = await run_cpu(request.app, assets.encode, prompt, True)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        prompt_ids = await encode_chat(request.app, assets,
                                       [*messages, {"role": "user", "content": prompt}])
    return await _answer(request, parsed, prompt_ids, assets, "response")


async def _load_or_unload(service: Any, parsed: OllamaRequest) -> web.Response:
    action = "unload" if parsed.keep_alive_s == 0 else "load"
    if action == "load":
        await service.control("load")
        apply_keep_alive(service, parsed.keep_alive_s)
    else:
        await service.control("unload")
    return web.json_response({"model": parsed.model, "created_at": _now(), "response": "",
                              "done": True, "done_reason": action})


def apply_keep_alive(service: Any, keep_alive_s: float | None) -> None:
    """keep_alive (seconds; < 0 forever) becomes the unload idle timer from now on."""
    if keep_alive_s is None or keep_alive_s == 0:
        return  # 0 unloads after the answer (after_answer)
    service.set_unload_idle(None if keep_alive_s < 0 else keep_alive_s)


async def after_answer(service: Any, keep_alive_s: float | None) -> None:
    """keep_alive 0: unload once the answer is out, as Ollama does."""
    if keep_alive_s != 0:
        return
    try:
        await service.control("unload")
    except ServiceError as exc:  # another request holds the model: it stays for that one
        log.info("keep_alive 0: the model stays loaded: %s", exc.message)


async def _answer(request: web.Request, parsed: OllamaRequest, prompt_ids: list[int],
                  assets: Any, field: str) -> web.StreamResponse:
    service = request.app[SERVICE_KEY]
    if parsed.context_tokens is not None:
        check_fits_context(len(prompt_ids), parsed.params.max_tokens,
                           min(parsed.context_tokens, service.context_tokens or
                               parsed.context_tokens))
    apply_keep_alive(service, parsed.keep_alive_s)
    started_ns = time.monotonic_ns()
    generation = await start_text_generation(service, assets, prompt_ids, parsed.params,
                                             parsed.grammar)
    clock = _Clock(started_ns)
    if parsed.params.is_stream:
        response = await _stream(request, generation, parsed, field, clock)
    else:
        try:
            text = await generation.collect()
        finally:
            await generation.close()
        response = web.json_response(
            {**_head(parsed, field, text), **_final(generation, clock)})
    await after_answer(service, parsed.keep_alive_s)
    return response


class _Clock:
    """Ollama's durations (ns): prompt evaluation until the first piece, then evaluation."""

    def __init__(self, started_ns: int):
        self.started_ns = started_ns
        self.first_ns: int | None = None

    def tick(self) -> None:
        if self.first_ns is None:
            self.first_ns = time.monotonic_ns()


def _head(parsed: OllamaRequest, field: str, text: str) -> dict[str, Any]:
    piece: Any = {"role": "assistant", "content": text} if field == "message" else text
    return {"model": parsed.model, "created_at": _now(), field: piece}


def _final(generation: TextGeneration, clock: _Clock) -> dict[str, Any]:
    end_ns = time.monotonic_ns()
    first_ns = clock.first_ns or end_ns
    usage = generation.usage
    return {"done": True, "done_reason": generation.finish_reason or "stop",
            "total_duration": end_ns - clock.started_ns, "load_duration": 0,
            "prompt_eval_count": usage.prompt_tokens if usage else 0,
            "prompt_eval_duration": first_ns - clock.started_ns,
            "eval_count": usage.completion_tokens if usage else 0,
            "eval_duration": end_ns - first_ns}


async def _write_line(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write((json.dumps(payload, ensure_ascii=False) + "\n").encode())


async def _stream(request: web.Request, generation: TextGeneration, parsed: OllamaRequest,
                  field: str, clock: _Clock) -> web.StreamResponse:
    """NDJSON lines; a failure after the headers ends with an `{"error": ...}` line."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        async for text in generation.deltas():
            clock.tick()
            await _write_line(response, {**_head(parsed, field, text), "done": False})
        await _write_line(response, {**_head(parsed, field, ""), **_final(generation, clock)})
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except ApiError as exc:
        await _write_line(response, {"error": exc.message})
    except Exception:  # the stream must end with an error line
        log.exception("stream %s failed", request.path)
        await _write_line(response, {"error": "internal server error; see the server log"})
    finally:
        await generation.close()
    return response
