"""Continuous batching with the default model (SmolLM2-135M Q4_1) on the CPU: eight chats in
one batch answer as each does alone, and grammar, penalties and sampling stay per sequence."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from strata.engine.api.grammar import json_schema_grammar
from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.text import TextAssets
from tests.core.batch_helpers import alone, assert_same_or_near_tie, run_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?",
             "Write a haiku about rain.", "Who wrote Hamlet?", "What is water made of?",
             "Say hello in Spanish.", "How many legs does a spider have?"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Engine:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_real_model.py: a shared 2-core machine
    engine = Engine(EngineConfig(model_path=str(smollm2_gguf), device="cpu",
                                 context_tokens=512, num_slots=8, prefill_chunk_tokens=32))
    engine.load()
    yield engine
    engine.close()
    torch.set_num_threads(num_threads)


def chat(assets: TextAssets, question: str) -> list[int]:
    return assets.encode_chat([{"role": "user", "content": question}])


def test_eight_chats_in_one_batch_answer_as_each_alone(engine, smollm2) -> None:
    spec = SamplingSpec(max_tokens=24, stop_token_ids=tuple(smollm2.eos_token_ids))
    prompts = [chat(smollm2, q) for q in QUESTIONS]
    expected = [alone(engine, p, spec, i) for i, p in enumerate(prompts)]
    batch = run_batch(engine, {f"c{i}": (p, spec, None) for i, p in enumerate(prompts)})
    assert len(batch.usage) == 8
    for i, prompt in enumerate(prompts):
        assert_same_or_near_tie(engine, prompt, expected[i], batch.tokens[f"c{i}"])
    for slot in range(8):
        engine.erase_slot(slot)


def test_grammar_penalties_and_sampling_stay_per_sequence(engine, smollm2) -> None:
    eos = tuple(smollm2.eos_token_ids)
    requests = {
        "json": (chat(smollm2, "Answer as JSON: capital of France?"),
                 SamplingSpec(max_tokens=32, stop_token_ids=eos,
                              grammar=json_schema_grammar(SCHEMA, "schema")), 0),
        "penalised": (chat(smollm2, "Repeat the word cat ten times."),
                      SamplingSpec(max_tokens=20, stop_token_ids=eos, repeat_penalty=1.5,
                                   frequency_penalty=0.5), 1),
        "sampled": (chat(smollm2, "Tell me a fact."),
                    SamplingSpec(max_tokens=16, stop_token_ids=eos, temperature=0.8, seed=7,
                                 logit_bias=((smollm2.encode("The")[0], 5.0),)), 2),
        "plain": (chat(smollm2, "Repeat the word cat ten times."),
                  SamplingSpec(max_tokens=20, stop_token_ids=eos), 3),
    }
    expected = {rid: alone(engine, p, s, slot) for rid, (p, s, slot) in requests.items()}
    batch = run_batch(engine, requests)
    for rid, (prompt, _, _) in requests.items():
        assert_same_or_near_tie(engine, prompt, expected[rid], batch.tokens[rid])
    text = smollm2.decode(batch.tokens["json"])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert batch.usage["json"].finish_reason == "stop"
    # The penalty changed that sequence only: the same prompt without it answers otherwise.
    assert batch.tokens["penalised"] != batch.tokens["plain"]
    for slot in range(4):
        engine.erase_slot(slot)
