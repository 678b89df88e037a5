"""Every route of the API, in one table."""

from __future__ import annotations

from aiohttp import web

from strata.engine.api import (
    anthropic_routes,
    control_routes,
    embedding_routes,
    infill_routes,
    llama_completion,
    llama_routes,
    ollama_pull,
    ollama_routes,
    openai_routes,
    responses_routes,
    template_routes,
)
from strata.engine.api.openapi import openapi_json


def setup_routes(app: web.Application) -> None:
    """Register the OpenAI, Anthropic, Ollama, llama.cpp-style and control routes on the app."""
    app.router.add_routes([
        web.post("/v1/chat/completions", openai_routes.chat_completions),
        web.post("/v1/completions", openai_routes.completions),
        web.get("/v1/models", openai_routes.list_models),
        web.get("/v1/models/{model:.+}", openai_routes.get_model),
        web.post("/v1/chat/completions/input_tokens", openai_routes.chat_input_tokens),
        web.post("/chat/completions/input_tokens", openai_routes.chat_input_tokens),
        web.post("/v1/responses/input_tokens", responses_routes.input_tokens),
        web.post("/responses/input_tokens", responses_routes.input_tokens),
        web.post("/v1/responses", responses_routes.create_response),
        web.get("/v1/responses/{response_id}", responses_routes.get_response),
        web.post("/v1/messages", anthropic_routes.messages),
        web.post("/v1/messages/count_tokens", anthropic_routes.count_tokens),
        web.get("/health", llama_routes.health),
        web.get("/v1/health", llama_routes.health),
        web.post("/apply-template", template_routes.apply_template),
        # llama.cpp serves the OpenAI routes without the /v1 prefix too; some clients use them.
        web.post("/chat/completions", openai_routes.chat_completions),
        # llama-server's /completions is its native /completion; OpenAI bodies go to
        # /v1/completions' handler (llama_completion.completions says how they are told).
        web.post("/completions", llama_completion.completions),
        web.post("/responses", responses_routes.create_response),
        web.get("/responses/{response_id}", responses_routes.get_response),
        web.get("/models", openai_routes.list_models),
        web.get("/props", llama_routes.props),
        web.get("/metrics", llama_routes.metrics),
        web.get("/v1/status", llama_routes.v1_status),
        web.get("/slots", llama_routes.slots),
        web.post("/tokenize", llama_routes.tokenize),
        web.post("/detokenize", llama_routes.detokenize),
        web.post("/completion", llama_completion.completion),
        web.post("/infill", infill_routes.infill),
        web.post("/slots/{slot_id}", control_routes.slot_action),
        *(web.post(path, control_routes.level_action) for path in control_routes.LEVEL_ACTIONS),
        web.post("/cache/shrink", control_routes.shrink_experts),
        web.get("/openapi.json", openapi_json),
        web.get("/api/version", ollama_routes.version),
        web.get("/api/tags", ollama_routes.tags),
        web.get("/api/ps", ollama_routes.ps),
        web.post("/api/show", ollama_routes.show),
        web.post("/api/chat", ollama_routes.chat),
        web.post("/api/generate", ollama_routes.generate),
        web.post("/api/pull", ollama_pull.pull_model),
        web.post("/v1/embeddings", embedding_routes.openai_embeddings),
        web.post("/embeddings", embedding_routes.embeddings),
        web.post("/embedding", embedding_routes.llama_embedding),
        web.post("/api/embed", embedding_routes.ollama_embed),
        web.post("/api/embeddings", embedding_routes.ollama_embeddings),
    ])
