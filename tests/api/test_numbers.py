"""Every numeric field of every route is finite, in range and an integer where one is meant,
else a 400 naming the field, and nothing runs (issue 51 item 6: keep_alive "NaN" unloaded the
model after every request; 1e400 and 5000-digit numbers gave 500s).

The bad values go in as raw JSON text: NaN and Infinity are what Python's json module (and
so a Python client) writes for float('nan') and float('inf')."""

from __future__ import annotations

import json

import pytest

USER = [{"role": "user", "content": "hi"}]
MODEL = "tiny-test-model"
HUGE_DIGITS = "9" * 5000
# Raw JSON for values no numeric field takes, and the text they stand for in test ids.
EVERY_FIELD = ["NaN", "Infinity", "-Infinity", "1e400", "1e300", "-1e300", "true", '"1"',
               HUGE_DIGITS, f"-{HUGE_DIGITS}"]

CHAT = ("/v1/chat/completions", {"messages": USER})
COMPLETION = ("/v1/completions", {"prompt": "hi"})
MESSAGES = ("/v1/messages", {"messages": USER, "max_tokens": 4})
RESPONSES = ("/v1/responses", {"input": "hi"})
OLLAMA_CHAT = ("/api/chat", {"model": MODEL, "messages": USER, "stream": False})
OLLAMA_GENERATE = ("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False})
LLAMA = ("/completion", {"prompt": "hi"})
EMBEDDING = ("/embedding", {"content": "hi"})
OPENAI_EMBEDDINGS = ("/v1/embeddings", {"input": "hi"})
OLLAMA_EMBED = ("/api/embed", {"model": MODEL, "input": "hi"})
SHRINK = ("/cache/shrink", {})

# (route, field path, values out of range for that field besides EVERY_FIELD)
FIELDS = [
    (CHAT, "max_tokens", ["0", "-1", "1.5"]), (CHAT, "max_completion_tokens", ["0"]),
    (CHAT, "temperature", ["-1", "2.5"]), (CHAT, "top_p", ["-1", "0", "1.5"]),
    (CHAT, "top_k", ["-1"]), (CHAT, "min_p", ["-1", "2"]), (CHAT, "seed", [str(2**64)]),
    (CHAT, "n", ["0", "9"]), (CHAT, "presence_penalty", ["-3", "3"]),
    (CHAT, "frequency_penalty", ["3"]), (CHAT, "repeat_penalty", ["-1", "0", "11"]),
    (CHAT, "repeat_last_n", ["-2"]), (CHAT, "strata_cache_slot", ["-1", "99"]),
    (CHAT, "id_slot", ["-2", "99"]), (CHAT, "ttl", ["-1", "0", "1e10"]),
    (CHAT, "logit_bias.5", ["-101", "101"]),
    (COMPLETION, "max_tokens", ["0"]), (COMPLETION, "logprobs", ["-1", "6"]),
    (COMPLETION, "best_of", ["0"]), (COMPLETION, "temperature", ["3"]),
    (MESSAGES, "max_tokens", ["0", "-1"]), (MESSAGES, "temperature", ["-1", "1.5"]),
    (MESSAGES, "top_p", ["0"]), (MESSAGES, "top_k", ["-1"]),
    (MESSAGES, "thinking.budget_tokens", ["1023", str(2**31)]),
    (RESPONSES, "max_output_tokens", ["0"]), (RESPONSES, "temperature", ["-1"]),
    (RESPONSES, "top_p", ["2"]),
    (OLLAMA_CHAT, "options.num_predict", ["-3", "0"]), (OLLAMA_CHAT, "options.temperature", ["-1"]),
    (OLLAMA_CHAT, "options.top_k", ["-1"]), (OLLAMA_CHAT, "options.top_p", ["0"]),
    (OLLAMA_CHAT, "options.min_p", ["2"]), (OLLAMA_CHAT, "options.seed", [str(2**64)]),
    (OLLAMA_CHAT, "options.num_ctx", ["0", "-1"]),
    (OLLAMA_CHAT, "options.repeat_penalty", ["-1"]), (OLLAMA_CHAT, "options.repeat_last_n", ["-2"]),
    (OLLAMA_CHAT, "options.presence_penalty", ["3"]),
    (OLLAMA_CHAT, "options.frequency_penalty", ["3"]),
    (OLLAMA_GENERATE, "options.num_predict", ["0"]), (OLLAMA_GENERATE, "options.num_ctx", ["0"]),
    (LLAMA, "n_predict", ["-2", "0"]), (LLAMA, "temperature", ["-1"]), (LLAMA, "top_k", ["-1"]),
    (LLAMA, "seed", [str(2**64)]), (LLAMA, "id_slot", ["-2", "99"]),
    (LLAMA, "n_probs", ["-1", "21"]), (LLAMA, "repeat_last_n", ["-2"]),
    (EMBEDDING, "embd_normalize", ["-2", "65"]),
    (OPENAI_EMBEDDINGS, "dimensions", ["0", "-1"]), (OPENAI_EMBEDDINGS, "ttl", ["0"]),
    (OLLAMA_EMBED, "options.num_ctx", ["0"]),
    (SHRINK, "keep_free_mib", ["-1", "1.5"]),
]
# keep_alive takes seconds or a duration string ("5m", "-1"), so "1" is no error for it.
KEEP_ALIVE_BAD = ['"NaN"', '"nan"', '"Infinity"', '"inf"', '"1e400"', '"-inf"', '"1_0"',
                  "1e10", '"1e10"', f'"{HUGE_DIGITS}"', "NaN", "1e400", "true", HUGE_DIGITS]
KEEP_ALIVE_ROUTES = [OLLAMA_CHAT, OLLAMA_GENERATE, OLLAMA_EMBED,
                     ("/api/embeddings", {"model": MODEL, "prompt": "hi"})]

CASES = [(route, field, raw) for route, field, extra in FIELDS for raw in EVERY_FIELD + extra]
CASES += [(route, "keep_alive", raw) for route in KEEP_ALIVE_ROUTES for raw in KEEP_ALIVE_BAD]


def body_text(base: dict, field: str, raw: str) -> str:
    """base with field (a dotted path) set to the raw JSON text."""
    body = json.loads(json.dumps(base))
    *parents, leaf = field.split(".")
    node = body
    for name in parents:
        node = node.setdefault(name, {"type": "enabled"} if name == "thinking" else {})
    node[leaf] = "__RAW__"
    return json.dumps(body).replace('"__RAW__"', raw)


def message_of(path: str, answer: dict) -> str:
    if path.startswith("/api/"):
        return answer["error"]
    return answer["error"]["message"]


def case_id(case) -> str:
    (path, _), field, raw = case
    return f"{path} {field}={raw[:12]}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
async def test_a_bad_number_is_a_400_naming_its_field(client, service, case):
    (path, base), field, raw = case
    response = await client.post(path, data=body_text(base, field, raw),
                                 headers={"Content-Type": "application/json"})
    answer = await response.json()
    assert response.status == 400, answer
    leaf = field.split(".")[-1] if not field.startswith("logit_bias") else "logit_bias"
    if field.startswith("thinking"):
        leaf = "budget_tokens"
    assert leaf in message_of(path, answer), answer
    assert service.calls == []


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {HUGE_DIGITS: 1}}),
    ("/v1/chat/completions", {"messages": USER, "logit_bias": {"\uff15": 1}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1" * 11: 1}}),
    ("/completion", {"prompt": "hi", "logit_bias": {HUGE_DIGITS: 1}}),
    ("/completion", {"prompt": "hi", "logit_bias": [[HUGE_DIGITS, 1]]}),
    ("/completion", {"prompt": "hi", "logit_bias": [[2**40, 1]]}),
])
async def test_logit_bias_token_ids_of_any_length_are_a_400(client, service, path, body):
    response = await client.post(path, json=body)
    answer = await response.json()
    assert response.status == 400 and answer["error"]["param"] == "logit_bias", answer
    assert service.calls == []


@pytest.mark.parametrize("value,timer_calls", [
    ("5m", [300.0]), ("-1", [None]), (-1, [None]), ("1h30m", [5400.0]), (90, [90.0]),
    ("2.5s", [2.5]), (0, []),
])
async def test_good_keep_alive_values_still_set_the_timer(client, service, value, timer_calls):
    response = await client.post("/api/generate", json={
        "model": MODEL, "prompt": "hi", "stream": False, "keep_alive": value})
    assert response.status == 200, await response.text()
    assert [c[1] for c in service.calls if c[0] == "set_unload_idle"] == timer_calls
