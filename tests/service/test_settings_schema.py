"""The settings schema drives the flags, the config file, the environment and EngineConfig alike:
every setting is reachable by its flag and by its key with the same result, the defaults agree
everywhere, and a bad value is one line naming the key."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from strata.cli import main as cli_main
from strata.engine.core.engine_config import EngineConfig
from strata.engine.service.settings import (
    SETTINGS,
    Goes,
    ServeSettings,
    SettingsError,
    add_serve_arguments,
    engine_config_for,
    environment_values,
    load_settings,
    overrides_from_args,
)
from strata.engine.service.settings_kinds import Boolean, NameList

WITH_KEY = [pytest.param(s, id=s.name) for s in SETTINGS if s.key is not None]
WITH_FLAG = [pytest.param(s, id=s.name) for s in SETTINGS if s.flag is not None]
# EngineConfig fields no setting sets: the model (resolved by the service), bench-only
# random weights, and the prefill chunks that have no user-facing knob yet.
# cpu_expert_misses and its forms' bound: set by bench/moe_budget_bench.py only, until a GPU
# run shows the CPU path faster than reading misses in place (docs/benchmarks.md, run 38).
ENGINE_ONLY = {"model_path", "random_weights", "prefill_chunk_tokens",
               "prefill_solo_chunk_tokens", "partial_cache_solo_chunk_tokens",
               "cpu_expert_misses", "cpu_expert_cache_bytes"}


@pytest.fixture(autouse=True)
def no_standard_config_file(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_CONFIG", str(tmp_path / "absent.toml"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def _toml(value) -> str:
    return json.dumps(value)  # the samples are strings, numbers, booleans and string lists


def _flag_argv(spec) -> list[str]:
    if isinstance(spec.kind, Boolean):
        return [spec.flag if spec.sample else "--no-" + spec.flag[2:]]
    sample = ",".join(spec.sample) if isinstance(spec.kind, NameList) else str(spec.sample)
    return [spec.flag, sample]


@pytest.mark.parametrize("spec", WITH_FLAG)
def test_every_flag_reaches_its_setting_like_its_config_key(spec, tmp_path):
    assert spec.key is not None, "a setting with a flag has a config key too"
    args = _parser().parse_args(_flag_argv(spec))
    by_flag = getattr(load_settings(None, overrides_from_args(args), environ={}), spec.name)
    path = tmp_path / "config.toml"
    path.write_text(f"{spec.key} = {_toml(spec.sample)}\n", encoding="utf-8")
    by_key = getattr(load_settings(path, {}, environ={}), spec.name)
    assert by_flag == by_key == spec.check(spec.sample)
    assert by_key != spec.default, "the sample must differ from the default to prove anything"
    path.write_text(f"{spec.name} = {_toml(spec.sample)}\n", encoding="utf-8")
    assert getattr(load_settings(path, {}, environ={}), spec.name) == by_key  # the field's name


def test_defaults_agree_between_the_schema_the_dataclass_flags_and_engine_config():
    settings = ServeSettings()
    for spec in SETTINGS:
        assert getattr(settings, spec.name) == spec.check(spec.default), spec.name
    assert all(value is None for value in vars(_parser().parse_args([])).values())
    assert load_settings(None, {}, environ={}) == settings
    assert engine_config_for(settings, "m.gguf") == EngineConfig(model_path="m.gguf")


def test_every_engine_config_field_has_a_setting():
    set_by_schema = {s.engine_field for s in SETTINGS if s.goes is Goes.ENGINE}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set_by_schema <= fields, "engine_field names a field EngineConfig lacks"
    assert fields - set_by_schema == ENGINE_ONLY


def test_every_setting_reaches_its_part():
    for spec in SETTINGS:
        assert spec.goes in Goes and spec.help and spec.kind is not None, spec.name
        assert (spec.engine_field is not None) == (spec.goes is Goes.ENGINE), spec.name
        assert spec.flag or spec.key or spec.env, f"{spec.name} cannot be set"


def test_engine_config_gets_the_values_the_settings_hold():
    settings = ServeSettings(slots=6, parallel=3, expert_cache=12, context_tokens=512,
                             fast_cuda_graphs=False, device="cpu")
    config = engine_config_for(settings, "m.gguf")
    assert (config.num_slots, config.parallel, config.context_tokens) == (6, 3, 512)
    assert config.expert_cache == "12" and config.fast_cuda_graphs is False
    assert config.device == "cpu" and config.fast_decode is True


def test_expert_cache_has_one_vocabulary():
    for value, expected in (("auto", "auto"), ("ALL", "all"), (" off ", "off"), (16, 16),
                            ("16", 16), ("8GiB", "8gib"), ("512 MiB", "512 mib")):
        assert ServeSettings(expert_cache=value).expert_cache == expected
        engine = engine_config_for(ServeSettings(expert_cache=value), "m").expert_cache
        assert engine == EngineConfig(model_path="m", expert_cache=str(value)).expert_cache
    for bad in ("0", 0, "lots", "8TB", True):
        with pytest.raises(SettingsError, match="'expert_cache' must be auto, off, all"):
            ServeSettings(expert_cache=bad)
        with pytest.raises(ValueError):
            EngineConfig(model_path="m", expert_cache=str(bad))


def test_the_fast_path_switches_come_from_the_environment_into_engine_config(tmp_path):
    environ = {"STRATA_FAST_GRAPHS": "0", "STRATA_FAST_DENSE": "1",
               "STRATA_FAST_PREFILL_GRAPHS": "0", "STRATA_API_KEY": " k ", "STRATA_FAST": ""}
    settings = load_settings(None, {}, environ=environ)
    config = engine_config_for(settings, "m")
    assert (config.fast_cuda_graphs, config.fast_dense_kernels) == (False, True)
    assert config.fast_compile_pointwise is None and config.fast_fused_attention is None
    assert config.fast_prefill_graphs is False and config.fast_decode is True  # "" is unset
    assert settings.api_key == "k"
    assert engine_config_for(load_settings(None, {}, environ={"STRATA_FAST": "0"}),
                             "m").fast_decode is False
    assert environment_values({}) == {}
    with pytest.raises(SettingsError, match=r"^STRATA_FAST_ATTENTION must be 0 or 1, got 'yes'$"):
        load_settings(None, {}, environ={"STRATA_FAST_ATTENTION": "yes"})


def test_the_batching_settings(tmp_path):
    settings = load_settings(None, {"slots": 8, "parallel": 8, "max_queue": 16}, environ={})
    assert (settings.slots, settings.parallel, settings.max_queue) == (8, 8, 16)
    with pytest.raises(SettingsError, match=r"'parallel' must be 0\.\.slots \(4\), got 5"):
        ServeSettings(parallel=5)
    with pytest.raises(SettingsError, match="'slots' must be >= 1, got 0"):
        ServeSettings(slots=0)


@pytest.mark.parametrize("spec", WITH_KEY)
def test_a_bad_value_is_one_line_naming_the_key(spec, tmp_path):
    path = tmp_path / "config.toml"
    path.write_text(f"{spec.key} = {{ oops = 1 }}\n", encoding="utf-8")  # a table: never valid
    with pytest.raises(SettingsError) as error:
        load_settings(path, {}, environ={})
    message = str(error.value)
    assert "\n" not in message and str(path) in message and f"'{spec.key}'" in message


def test_strata_serve_says_a_bad_config_value_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.toml"
    path.write_text('port = 8080\nsleep-idle = "soon"\n', encoding="utf-8")
    assert cli_main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"strata: error: config file {path}: 'sleep-idle' must be a number of "
                   "seconds, got 'soon' (str)")
