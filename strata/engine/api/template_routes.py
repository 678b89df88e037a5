"""llama.cpp's POST /apply-template: the chat template applied, without generating."""

from __future__ import annotations

from aiohttp import web

from strata.engine.api.chat_messages import parse_openai_messages
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import bad_request
from strata.engine.api.model_routing import service_of
from strata.engine.api.textgen import text_assets
from strata.engine.api.validation import read_json_object
from strata.engine.text import ChatTemplateError


async def apply_template(request: web.Request) -> web.Response:
    """POST /apply-template {"messages"} -> {"prompt"}: what /v1/chat/completions would feed
    the model, for editor plugins that build their own prompts."""
    body = await read_json_object(request)
    messages = parse_openai_messages(body)  # tool calls and results too, as chat takes them
    assets = text_assets(service_of(request))
    try:  # templates from model files can be slow: keep /health answering meanwhile
        prompt = await run_cpu(request.app, assets.apply_chat_template, messages)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template refused the messages: {exc}",
                          param="messages") from None
    return web.json_response({"prompt": prompt})
