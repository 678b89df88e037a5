"""Which of llama.cpp's server tests are model-agnostic, and why the others are not.

A test is model-agnostic when it checks the HTTP API (shapes, fields, errors, streaming,
limits) and would pass on any small chat model. It is not when it needs a model feature
(a draft model, LoRA, vision, rerank, an infill model, an embedding model's own vectors),
the exact text of llama.cpp's stories260K test model, a llama-server-only feature with no
place in Strata's API (the router's model presets, the web UI's MCP proxy, built-in tools,
Vertex AI mode, slot files), or a chat template file from llama.cpp's repository.
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
}

# Single tests (regex on the test id) that are not model-agnostic, with the reason.
TESTS: list[tuple[str, str]] = []


def classify(test_id: str) -> str | None:
    """None when test_id (as pytest prints it) is model-agnostic, else why it is not."""
    file_name = test_id.split("::")[0]
    if file_name in FILES:
        return FILES[file_name]
    for pattern, reason in TESTS:
        if re.search(pattern, test_id):
            return reason
    return None
