"""Ollama-compatible routes, so apps that only know Ollama's API find and use Strata.

/api/version, /api/tags, /api/show, /api/ps, /api/chat (tools and `think` included) and
/api/generate (answers in ollama_chat.py); embeddings are in embedding_routes.py. Streaming
answers are NDJSON (one JSON object a line), as Ollama sends them; errors are `{"error": "..."}`.
`keep_alive` maps onto Strata's unload idle timer (docs/api.md, "Ollama API").
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from strata import __version__ as STRATA_VERSION
from strata.engine.api.chat_output import ChatOutput
from strata.engine.api.chat_plan import ChatInputs, ChatPlan, plan_chat
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.model_list import ollama_ps, ollama_tags
from strata.engine.api.model_routing import model_pool, service_of
from strata.engine.api.ollama_chat import Clock, answer_stream, answer_whole, now
from strata.engine.api.ollama_params import (
    OllamaRequest,
    parse_ollama,
    parse_ollama_messages,
    parse_ollama_think,
)
from strata.engine.api.openai_routes import model_status
from strata.engine.api.textgen import check_fits_context, start_text_generation, text_assets
from strata.engine.api.tool_spec import ToolRequest, parse_openai_tools
from strata.engine.api.validation import read_json_object
from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import resident_bytes
from strata.engine.text.harmony import template_is_harmony
from strata.engine.text.reasoning import template_thinks

log = logging.getLogger(__name__)
# The Ollama API level these routes follow; apps compare it against their minimum.
OLLAMA_API_VERSION = "0.12.0"
_TAG = ":latest"


def _served_name(service: Any) -> str:
    """Ollama's name of the served model: tagged ':latest' unless the name (an --alias such
    as 'coder:7b') has a tag of its own."""
    name = service.model_id
    return name if ":" in name else f"{name}{_TAG}"


def check_model(request: web.Request, service: Any, name: Any) -> None:
    """404 in Ollama's words unless `name` is the served model (with or without ':latest').
    A ModelPool's resolver (model_routing.py) has already found the model by that name."""
    if model_pool(request.app) is not None:
        return
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
    pool = model_pool(request.app)
    if pool is not None:
        return web.json_response(ollama_tags(pool))
    service = service_of(request)
    facts = await _facts(service)
    name = _served_name(service)
    return web.json_response({"models": [{
        "name": name, "model": name, "modified_at": facts["modified_at"],
        "size": facts["size"], "digest": facts["digest"], "details": _details(facts)}]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the models while they hold memory (loaded or sleeping), with their VRAM."""
    pool = model_pool(request.app)
    if pool is not None:
        return web.json_response(ollama_ps(pool))
    service = service_of(request)
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
    service = service_of(request)
    body = await read_json_object(request)
    check_model(request, service, body.get("model", body.get("name")))
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
        "capabilities": _capabilities(assets.chat_template)})


def _capabilities(template: str | None) -> list[str]:
    """Ollama's capability words: every model gets tools (a template that cannot render them
    gets Strata's Hermes prompt), and thinking where its template writes a think block or
    Harmony's analysis channel."""
    thinks = template_thinks(template) or template_is_harmony(template)
    return ["completion", "tools", *(["thinking"] if thinks else [])]


async def chat(request: web.Request) -> web.StreamResponse:
    """POST /api/chat: tools, tool results and `think` included."""
    clock = Clock()
    service = service_of(request)
    body = await read_json_object(request)
    parsed = await run_cpu(request.app, parse_ollama, body)  # `format` compiles: off the loop
    check_model(request, service, parsed.model)
    tools = parse_openai_tools({"tools": body.get("tools")})
    messages = parse_ollama_messages(body)
    assets = text_assets(service)
    think, effort = parse_ollama_think(body)
    plan = await plan_chat(request.app, assets, ChatInputs(
        messages, tools, parsed.grammar, think, thinking_param="think", effort=effort,
        effort_param="think"))
    return await _answer(request, parsed, plan, assets, "message", clock)


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /api/generate; an empty prompt only loads (or, with keep_alive 0, unloads)."""
    clock = Clock()
    service = service_of(request)
    body = await read_json_object(request)
    parsed = await run_cpu(request.app, parse_ollama, body,
                           refuse=("tools", "suffix", "template", "context"))
    check_model(request, service, parsed.model)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", param="prompt")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad_request("'system' must be a string", param="system")
    think, effort = parse_ollama_think(body)
    if not prompt:
        return await _load_or_unload(service, parsed)
    assets = text_assets(service)
    if body.get("raw"):
        if think is not None or effort is not None:
            raise bad_request("'think' needs the chat template, which 'raw' leaves out",
                              param="think")
        prompt_ids = await run_cpu(request.app, assets.encode, prompt, True)
        plan = ChatPlan(list(prompt_ids), parsed.grammar, None, ToolRequest(), False, False)
    else:
        messages = [{"role": "system", "content": system}] if system else []
        plan = await plan_chat(request.app, assets, ChatInputs(
            [*messages, {"role": "user", "content": prompt}], output_grammar=parsed.grammar,
            thinking=think, thinking_param="think", effort=effort, effort_param="think"))
    return await _answer(request, parsed, plan, assets, "response", clock)


async def _load_or_unload(service: Any, parsed: OllamaRequest) -> web.Response:
    action = "unload" if parsed.keep_alive_s == 0 else "load"
    if action == "load":
        await service.control("load")
        apply_keep_alive(service, parsed.keep_alive_s)
    else:
        await service.control("unload")
    return web.json_response({"model": parsed.model, "created_at": now(), "response": "",
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


async def _answer(request: web.Request, parsed: OllamaRequest, plan: ChatPlan,
                  assets: Any, field: str, clock: Clock) -> web.StreamResponse:
    service = service_of(request)
    if parsed.context_tokens is not None:
        check_fits_context(len(plan.prompt_ids), parsed.params.max_tokens,
                           min(parsed.context_tokens, service.context_tokens or
                               parsed.context_tokens))
    apply_keep_alive(service, parsed.keep_alive_s)
    generation = await start_text_generation(service, assets, plan.prompt_ids, parsed.params,
                                             plan.grammar)
    output = ChatOutput(generation, plan, "call_")
    if parsed.params.is_stream:
        response = await answer_stream(request, output, parsed, field, clock)
    else:
        response = await answer_whole(output, parsed, field, clock)
    await after_answer(service, parsed.keep_alive_s)
    return response
