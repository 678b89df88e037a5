"""EngineConfig's fast_* fields (set from the settings schema, STRATA_FAST* in the environment)
reach the decoder: the switches the engine once read from os.environ itself (issue 21)."""

from __future__ import annotations

import pytest

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.service.settings import engine_config_for, settings_from_config
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("gpu-fast-switches"))
    return str(path)


def greedy(engine: Engine) -> list[int]:
    spec = SamplingSpec(max_tokens=12, temperature=0.0)
    return [t for ids in engine.generate(list(range(5, 30)), spec) for t in ids]


def test_the_fast_switches_reach_the_decoder(model_path) -> None:
    settings = settings_from_config({}, {"device": "cuda"}, environ={"STRATA_FAST_GRAPHS": "0"})
    no_graphs = Engine(engine_config_for(settings, model_path))
    plain = Engine(EngineConfig(model_path=model_path, device="cuda", fast_decode=False))
    default = Engine(EngineConfig(model_path=model_path, device="cuda"))
    engines = (no_graphs, plain, default)
    try:
        for engine in engines:
            engine.load()
        assert plain.fast is None
        assert no_graphs.fast is not None and not no_graphs.fast.use_cuda_graphs
        assert default.fast is not None and default.fast.use_cuda_graphs
        assert len(greedy(no_graphs)) == len(greedy(plain)) == 12  # each path decodes
    finally:
        for engine in engines:
            engine.close()
