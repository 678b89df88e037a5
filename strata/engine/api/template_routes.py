"""llama.cpp's POST /apply-template: the chat template applied, without generating."""

from __future__ import annotations

from aiohttp import web

from strata.engine.api.chat_plan import openai_chat_inputs, render_chat
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import bad_request
from strata.engine.api.model_routing import service_of
from strata.engine.api.params import parse_openai
from strata.engine.api.validation import read_json_object
from strata.engine.text import ChatTemplateError


async def apply_template(request: web.Request) -> web.Response:
    """POST /apply-template {"messages", "tools", ...} -> {"prompt"}: what /v1/chat/completions
    would feed the model for the same body (tools in the template or Strata's Hermes prompt,
    chat_template_kwargs, enable_thinking), for editor plugins that build their own prompts.
    It takes a whole chat body, as llama.cpp's does, and refuses what chat would refuse;
    the sampling fields shape no prompt, so they change nothing here."""
    body = await read_json_object(request)
    parse_openai(body, "/apply-template")  # chat's checks: its sampling shapes no prompt
    inputs, assets = openai_chat_inputs(body, service_of(request))
    render = render_chat(assets, inputs)
    try:  # templates from model files can be slow: keep /health answering meanwhile
        prompt = await run_cpu(request.app, assets.apply_chat_template, render.messages,
                               **render.template_kwargs)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template refused the messages: {exc}",
                          param="messages") from None
    return web.json_response({"prompt": prompt + render.prefill})
