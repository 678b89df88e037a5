"""Constrained decoding in the engine: the default model's output under a grammar always parses.

Both decode paths run on the CPU: the eager one (Engine without a GraphDecoder) and the
GraphDecoder's (graphs off, the same step function the CUDA graphs capture), which must agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from strata.engine.api.grammar import gbnf_grammar, json_schema_grammar
from strata.engine.core.engine import Engine, EngineConfig, EngineError
from strata.engine.protocol import SamplingSpec
from strata.engine.text import TextAssets

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0},
    "is_capital": {"type": "boolean"}},
    "required": ["city", "population", "is_capital"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(smollm2_gguf: Path) -> Engine:
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model_path=str(smollm2_gguf), device="cpu", context_tokens=512))
    engine.load()
    yield engine
    engine.close()
    torch.set_num_threads(num_threads)


def _run(engine: Engine, assets: TextAssets, grammar: str, temperature: float = 0.0,
         seed: int | None = None, max_tokens: int = 64) -> tuple[str, str]:
    prompt = assets.encode_chat([{"role": "user", "content": "Describe Paris as JSON."}])
    spec = SamplingSpec(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        stop_token_ids=assets.eos_token_ids, grammar=grammar)
    ids = [t for step in engine.generate(prompt, spec) for t in step]
    return assets.decode(ids), engine.last_usage.finish_reason


def test_eager_path_output_validates_against_the_schema(engine, smollm2) -> None:
    text, finish = _run(engine, smollm2, json_schema_grammar(SCHEMA, "schema"))
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_output_validates_too(engine, smollm2) -> None:
    for seed in (1, 2):
        text, finish = _run(engine, smollm2, json_schema_grammar(SCHEMA, "schema"),
                            temperature=1.0, seed=seed, max_tokens=96)
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_graph_decoder_path_gives_the_eager_paths_tokens(engine, smollm2) -> None:
    from strata.engine.core.fast import GraphDecoder

    grammar = json_schema_grammar(SCHEMA, "schema")
    eager, _ = _run(engine, smollm2, grammar)
    engine.fast = GraphDecoder(engine.model, use_cuda_graphs=False, compile_pointwise=False)
    try:
        fast, finish = _run(engine, smollm2, grammar)
    finally:
        engine.fast = None
    assert finish == "stop"
    jsonschema.validate(json.loads(fast), SCHEMA)
    assert fast == eager


def test_gbnf_grammar_is_followed(engine, smollm2) -> None:
    grammar = gbnf_grammar('root ::= ("yes" | "no") "!"')
    text, finish = _run(engine, smollm2, grammar)
    assert text in ("yes!", "no!") and finish == "stop"


def test_a_broken_grammar_is_an_engine_error(engine, smollm2) -> None:
    with pytest.raises(EngineError, match="grammar"):
        _run(engine, smollm2, '{"grammars": [{"lark_grammar": "start: nope"}]}')


# ---- property: any schema of the supported subset gives output that validates ---------------

_SCALARS = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda items: {"type": "string", "enum": items},
              st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3,
                       unique=True)),
    # Integers, not numbers: a JSON number's fraction and exponent have no length bound, so a
    # sampled one may run on to max_tokens ("length") while every prefix is still valid.
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 10},
              st.integers(-5, 5)),
    st.just({"type": "null"}),
)


def _objects(values):
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), values, min_size=1,
                           max_size=3).flatmap(lambda props: st.builds(
        # Closed objects: an open one lets the model add properties until max_tokens.
        lambda required: {"type": "object", "properties": props, "required": sorted(required),
                          "additionalProperties": False},
        st.sets(st.sampled_from(sorted(props)))))


_SCHEMAS = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        _objects(inner),
        st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n},
                  inner, st.integers(0, 2)),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner)),
    max_leaves=4)


# No shrinking: each example is a generation of seconds, and the failing schema is printed.
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(schema=_objects(_SCHEMAS), seed=st.integers(0, 2**16))
def test_random_schemas_always_give_valid_json(engine, smollm2, schema, seed) -> None:
    """Sampled (temperature 1), so the mask, not the model's taste, keeps the output valid."""
    text, finish = _run(engine, smollm2, json_schema_grammar(schema, "schema"),
                        temperature=1.0, seed=seed, max_tokens=160)
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "generic", "glm"])
def test_forced_call_grammar_output_parses_back_in_its_format(engine, smollm2, fmt) -> None:
    """What the forced-call grammar lets the model write, the same format's parser reads."""
    from strata.engine.api.tool_prompt import call_grammar
    from strata.engine.api.tool_spec import Tool
    from strata.engine.text.tool_calls import parse_all

    params = {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
    tools = (Tool("get_weather", "", params), Tool("get_time", "", {"type": "object", "properties": {},
                                                          "additionalProperties": False}))
    text, finish = _run(engine, smollm2, call_grammar(fmt, tools, is_parallel=False),
                        max_tokens=80)
    assert finish == "stop", text
    content, calls = parse_all(fmt, text)
    assert content.strip() == "" and len(calls) == 1, text
    if calls[0].name == "get_weather":
        jsonschema.validate(json.loads(calls[0].arguments), params)
    else:
        assert calls[0].name == "get_time" and isinstance(json.loads(calls[0].arguments), dict)
