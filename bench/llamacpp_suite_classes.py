"""Which of llama.cpp's server tests are model-agnostic, and why the others are not.

A test is model-agnostic when it checks the HTTP API (shapes, fields, errors, streaming,
limits) and would pass on any small chat model. It is not when it needs a model feature
(a draft model, LoRA, vision, rerank, an infill model, an embedding model's own vectors),
the exact text of llama.cpp's stories260K test model, a llama-server-only feature with no
place in Strata's API (the router's model presets, the web UI's MCP proxy, built-in tools,
Vertex AI mode, slot files), or a chat template file from llama.cpp's repository; or when
the test cannot pass on any server (a bug in the test itself).
classify() answers None for a model-agnostic test, else the reason.
"""

from __future__ import annotations

import re

# Whole files that are not model-agnostic, with the reason.
FILES = {
    "unit/test_lora.py": "LoRA adapters",
    "unit/test_speculative.py": "a draft model (speculative decoding)",
    "unit/test_vision_api.py": "a vision model (mmproj)",
    "unit/test_rerank.py": "a reranking model",
    "unit/test_infill.py": "an infill (FIM) model's outputs",
    "unit/test_mcp_servers.py": "the web UI's MCP proxy (llama-server only)",
    "unit/test_proxy.py": "the web UI's CORS proxy (llama-server only)",
    "unit/test_tools_builtin.py": "llama-server's built-in tools (llama-server only)",
    "unit/test_router.py": "the multi-model router and its presets (llama-server only)",
    "unit/test_compat_gcp.py": "Vertex AI prediction mode (llama-server only)",
    "unit/test_slot_save.py": "slot files on disk (--slot-save-path, llama-server only)",
    "unit/test_template.py": "chat template files of llama.cpp's models/templates",
    "unit/test_tool_call.py": "chat template files and tool-call formats of named models",
    "unit/test_ctx_shift.py": "context shift of the stories260K model's exact outputs",
    "unit/test_kv_keep_only_active.py": "llama.cpp's KV cache internals",
    "unit/test_stream.py": "the router's resumable streams (llama-server only)",
}

_STORIES_TEXT = "the text or token counts of stories260K (llama.cpp's test model)"
_TEMPLATE = "a named chat template (llama3, command-r, a models/templates file)"

# Single tests (regex on the test id) that are not model-agnostic, with the reason.
TESTS: list[tuple[str, str]] = [
    # test_basic.py
    (r"test_basic.py::test_load_split_model", "a split GGUF download of stories15M and its text"),
    (r"test_basic.py::test_no_ui", "llama-server's web UI"),
    (r"test_basic.py::test_server_model_aliases_and_tags", "llama-server's router aliases and "
     "--tags"),
    # test_security.py
    (r"test_security.py::test_access_static_assets", "llama-server's web UI"),
    (r"test_security.py::test_cors_origins_defaults_to_localhost_with_tools",
     "llama-server's built-in tools"),
    (r"test_security.py::test_cors_proxy", "the web UI's CORS proxy (llama-server only)"),
    (r"test_security.py::test_local_media_file", "multimodal media files (--media-path)"),
    # test_completion.py
    (r"test_completion.py::test_completion\[", _STORIES_TEXT),
    (r"test_completion.py::test_completion_stream\[", _STORIES_TEXT),
    (r"test_completion.py::test_completion_(stream_)?with_openai_library$", _STORIES_TEXT),
    (r"test_completion.py::test_completion_stream_with_openai_library_stops",
     "Phi-3.5-mini's text"),
    (r"test_completion.py::test_cache_vs_nocache_prompt", "skipped upstream (fails on Linux)"),
    (r"test_completion.py::test_nocache_long_input_prompt", "a prompt over the context only "
     "in stories260K's tokens"),
    (r"test_completion.py::test_completion_unified", "llama.cpp's unified KV pool sizes"),
    (r"test_completion.py::test_completion_response_fields\[.*-32-", "stories260K's '<s> ' "
     "prompt prefix"),
    (r"test_completion.py::test_n_probs_post_backend_sampling", "llama.cpp's backend sampler"),
    (r"test_completion.py::test_completion_prompt_cache", _STORIES_TEXT),
    # test_chat_completion.py
    (r"test_chat_completion.py::test_chat_completion\[", _STORIES_TEXT),
    (r"test_chat_completion.py::test_chat_completion_cached_tokens", _STORIES_TEXT),
    (r"test_chat_completion.py::test_chat_completion_stream\[", _STORIES_TEXT),
    (r"test_chat_completion.py::test_chat_completion_with_openai_library", _STORIES_TEXT),
    (r"test_chat_completion.py::test_chat_template$", _TEMPLATE),
    (r"test_chat_completion.py::test_chat_template_assistant_prefill", _TEMPLATE),
    (r"test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat",
     _TEMPLATE),
    (r"test_chat_completion.py::test_apply_chat_template", _TEMPLATE),
    (r"test_chat_completion.py::test_completion_with_response_format\[response_format1-",
     "the integer stories260K writes"),
    (r"test_chat_completion.py::test_return_progress", "llama.cpp's --batch-size prompt "
     "chunks of stories260K's tokens"),
    # test_compat_oai_responses.py: both look for "Suddenly" in the answer
    (r"test_compat_oai_responses.py::test_responses_(stream_)?with_openai_library",
     _STORIES_TEXT),
    (r"test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry",
     "fails on any server, llama-server too: it reads `.body` of the generator that "
     "make_stream_request returns (AttributeError)"),
    # test_embedding.py
    (r"test_embedding.py::test_embedding_mixed_input\[-False\]", "a model that adds special "
     "tokens (CLS/BOS) to an empty text"),
    (r"test_embedding.py::test_embedding_usage_", "the token counts of bge-small's tokenizer"),
    (r"test_embedding.py::test_embedding_pooling_none$", "bge-small's tokenizer: 3 text "
     "tokens and its CLS and SEP make the 5 vectors it counts"),
    # test_tokenize.py
    (r"test_tokenize.py::test_tokenize_with_bos", "stories260K's BOS token id (1)"),
    # test_compat_anthropic.py
    (r"test_compat_anthropic.py::test_anthropic_vision", "a vision model"),
    (r"test_compat_anthropic.py::test_anthropic_tool_result_with_image", "a vision model"),
    (r"test_compat_anthropic.py::test_anthropic_thinking_history_in_", "Qwen3's chat template"),
    (r"test_compat_anthropic.py::test_anthropic_thinking_with_reasoning_model",
     "DeepSeek-R1-Distill's reasoning"),
]


def classify(test_id: str) -> str | None:
    """None when test_id (as pytest prints it) is model-agnostic, else why it is not."""
    file_name = test_id.split("::")[0]
    if file_name in FILES:
        return FILES[file_name]
    for pattern, reason in TESTS:
        if re.search(pattern, test_id):
            return reason
    return None
