"""Constrained decoding on CUDA: the decode graph stops at the logits, the mask applies after.

The default model on the GPU engine (CUDA graphs on) must give schema-valid JSON, the same
greedy tokens as the GraphDecoder with graphs off, and leave unconstrained decoding as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from strata.engine.api.grammar import json_schema_grammar
from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.text import TextAssets

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["old", "big", "rainy"]},
             "maxItems": 3}},
    "required": ["city", "population", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Engine:
    engine = Engine(EngineConfig(model_path=str(smollm2_gguf), device="cuda",
                                 context_tokens=1024))
    engine.load()
    yield engine
    engine.close()


def _run(engine: Engine, assets: TextAssets, grammar: str | None, seed: int | None = None
         ) -> tuple[str, str]:
    prompt = assets.encode_chat([{"role": "user", "content": "Describe Paris as JSON."}])
    spec = SamplingSpec(max_tokens=96, temperature=0.0 if seed is None else 1.0, seed=seed,
                        stop_token_ids=assets.eos_token_ids, grammar=grammar)
    ids = [t for step in engine.generate(prompt, spec) for t in step]
    return assets.decode(ids), engine.last_usage.finish_reason


def test_graph_path_gives_valid_json(engine, smollm2) -> None:
    assert engine.fast is not None and engine.fast.use_cuda_graphs
    grammar = json_schema_grammar(SCHEMA, "schema")
    for seed in (None, 1, 2, 3):
        text, finish = _run(engine, smollm2, grammar, seed)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_graphs_and_eager_steps_agree(engine, smollm2) -> None:
    grammar = json_schema_grammar(SCHEMA, "schema")
    graphed, _ = _run(engine, smollm2, grammar)
    engine.fast.use_cuda_graphs = False
    try:
        eager, _ = _run(engine, smollm2, grammar)
    finally:
        engine.fast.use_cuda_graphs = True
    assert graphed == eager


def test_unconstrained_requests_still_decode_in_whole_graphs(engine, smollm2) -> None:
    before, _ = _run(engine, smollm2, None)
    _run(engine, smollm2, json_schema_grammar(SCHEMA, "schema"))
    after, _ = _run(engine, smollm2, None)
    assert before == after and before
