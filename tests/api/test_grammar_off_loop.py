"""Output grammars compile off the event loop (issue 51 item 8): a large JSON schema took up
to 1.6 s in llguidance, and /health waited as long. Each route's grammar (response_format,
completions, Anthropic's output_config, Ollama's format, Responses' text.format, a forced
tool call) must be
checked on a worker thread (llguidance releases the GIL there, so the loop runs on)."""

from __future__ import annotations

import threading

import pytest

from strata.engine.api import grammar

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
CASES = [
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
    ("/v1/chat/completions", {"messages": USER, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "f"}}}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}),
    ("/v1/messages", {"messages": USER, "max_tokens": 4, "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}}}),
    ("/api/chat", {"model": "tiny-test-model", "messages": USER, "format": SCHEMA,
                   "stream": False}),
    ("/api/generate", {"model": "tiny-test-model", "prompt": "hi", "format": "json",
                       "stream": False}),
    ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA}}}),
]


@pytest.fixture
def checked_on(monkeypatch) -> list[threading.Thread]:
    """The threads grammar._checked (llguidance's validation: the slow part) ran on."""
    threads: list[threading.Thread] = []
    real = grammar._checked

    def observed(*args, **kwargs):
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(grammar, "_checked", observed)
    return threads


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p} {sorted(b)[-1]}" for p, b in CASES])
async def test_every_routes_grammar_compiles_off_the_event_loop(client, checked_on, path, body):
    response = await client.post(path, json=body)
    # The tiny test model's context may not hold the tool prompt: a 400 after the compile.
    assert response.status in (200, 400), await response.text()
    assert checked_on and threading.main_thread() not in checked_on, checked_on
