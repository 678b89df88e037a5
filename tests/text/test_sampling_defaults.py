"""Sampling defaults: settings over the model file's own over llama.cpp's (issue 17 item 16)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import pytest

from strata.default_model import DEFAULT_MODEL_FILENAME
from strata.engine.service.service import model_sampling_defaults
from strata.engine.service.settings import (
    ServeSettings,
    SettingsError,
    add_serve_arguments,
    load_settings,
    overrides_from_args,
)
from strata.engine.text.sampling_defaults import (
    SamplingDefaults,
    read_model_sampling,
    resolve_sampling_defaults,
)


def write_gguf(path: Path, **metadata) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        name = f"general.sampling.{key}"
        if isinstance(value, int):
            writer.add_int32(name, value)
        else:
            writer.add_float32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_cpp_defaults_when_nothing_says_otherwise() -> None:
    defaults = resolve_sampling_defaults({}, {})
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == \
        (0.8, 40, 0.95, 0.05)
    assert set(defaults.sources.values()) == {"llama.cpp"}


def test_gguf_general_sampling_keys_are_read(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", temp=0.6, top_k=20, top_p=0.8, min_p=0.0,
                      penalty_repeat=1.05, penalty_last_n=128)
    assert read_model_sampling(path) == pytest.approx({
        "temperature": 0.6, "top_k": 20, "top_p": 0.8, "min_p": 0.0,
        "repeat_penalty": 1.05, "repeat_last_n": 128})


def test_generation_config_json_is_read(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
         "repetition_penalty": 1.1, "eos_token_id": 2}))
    assert read_model_sampling(tmp_path) == pytest.approx(
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "repeat_penalty": 1.1})
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert read_model_sampling(tmp_path) == {"temperature": 0.0}  # transformers: greedy


def test_settings_win_over_the_model_which_wins_over_llama_cpp(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", temp=0.6, top_k=20)
    defaults = model_sampling_defaults(ServeSettings(top_k=5, min_p=0.1), str(path))
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == \
        pytest.approx((0.6, 5, 0.95, 0.1))
    assert defaults.sources == {"temperature": "model", "top_k": "settings",
                                "top_p": "llama.cpp", "min_p": "settings",
                                "repeat_penalty": "llama.cpp", "repeat_last_n": "llama.cpp",
                                "seed": "llama.cpp", "max_tokens": "llama.cpp"}


def test_the_embedded_default_model_decodes_greedily(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / DEFAULT_MODEL_FILENAME)  # declares nothing, as the real one
    defaults = model_sampling_defaults(ServeSettings(), str(path))
    assert defaults.temperature == 0.0 and defaults.sources["temperature"].startswith("strata")
    assert model_sampling_defaults(ServeSettings(temperature=0.5), str(path)).temperature == 0.5


def test_sampling_settings_from_flags_and_the_config_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--temperature", "0.3", "--top-k", "8", "--repeat-last-n", "-1"])
    config = tmp_path / "config.toml"
    config.write_text("top-p = 0.5\nmin_p = 0.2\ntemperature = 1.5\n")
    settings = load_settings(config, overrides_from_args(args))
    assert (settings.temperature, settings.top_k, settings.top_p, settings.min_p,
            settings.repeat_last_n) == (0.3, 8, 0.5, 0.2, -1)


@pytest.mark.parametrize("name,value,needle", [
    ("temperature", 2.5, "'temperature' must be in 0.0..2.0"),
    ("top_p", 0.0, "above 0"),
    ("top_k", 1.5, "'top_k' must be an integer"),
    ("min_p", "high", "'min_p' must be a number"),
    ("repeat_last_n", -2, "'repeat_last_n' must be in -1.."),
])
def test_bad_sampling_settings_are_one_line_errors(name, value, needle) -> None:
    with pytest.raises(SettingsError, match=needle):
        ServeSettings(**{name: value})


def test_props_params_use_llama_cpp_names() -> None:
    params = SamplingDefaults().params()
    assert {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
            "presence_penalty", "frequency_penalty"} <= set(params)


def test_a_sampling_table_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("port = 9000\n[sampling]\ntemperature = 0.4\ntop-k = 12\n")
    settings = load_settings(config, {})
    assert (settings.port, settings.temperature, settings.top_k) == (9000, 0.4, 12)
    config.write_text("[sampling]\nmirostat = 2\n")
    with pytest.raises(SettingsError, match="unknown key 'mirostat' in \\[sampling\\]"):
        load_settings(config, {})
    config.write_text("temperature = 0.1\n[sampling]\ntemperature = 0.4\n")
    with pytest.raises(SettingsError, match="both at the top level and in \\[sampling\\]"):
        load_settings(config, {})
