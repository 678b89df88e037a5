"""`strata generate` / `strata info` on a first run: one-line errors, and a bare prompt that
answers instead of printing a blank line (issue #17 item 22)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata.cli import main


def strata(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("command", [("generate", "hi", "--model"), ("info",)])
def test_a_missing_model_is_one_line_and_exit_2(command):
    done = strata(*command, "/missing.gguf")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [(
        "strata: error: model /missing.gguf not found: pass a .gguf file or a Hugging Face "
        "directory, or leave --model out for the default model")]


def test_a_file_that_is_no_model_is_one_line(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a gguf file at all")
    done = strata("generate", "hi", "--model", str(bad))
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("strata: error: ") and "notes.gguf" in done.stderr


@pytest.mark.slow
def test_a_bare_prompt_to_an_instruct_model_answers(smollm2_gguf, capsys):
    # Without the chat template SmolLM2-Instruct ended the turn at once: a blank line.
    assert main(["generate", "What is the capital of France?", "--model", str(smollm2_gguf),
                 "--device", "cpu", "--max-tokens", "12"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and out.err == ""


def test_raw_and_chat_exclude_each_other():
    done = strata("generate", "hi", "--raw", "--chat")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


def test_bench_help_says_all_the_suite_does():
    done = strata("bench", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "against measured limits and a peer." in text
    assert "Targets: DESIGN.md §8." in text and "--no-lifecycle" in text


@pytest.mark.slow
def test_generate_piped_into_a_cp1252_stream_replaces_what_it_cannot_encode(smollm2_gguf):
    # Windows pipes are cp1252: Japanese text ended the command in a UnicodeEncodeError.
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli", "generate", " ".join(["日本"] * 8), "--raw",
         "--model", str(smollm2_gguf), "--device", "cpu", "--max-tokens", "8",
         "--temperature", "0"],
        capture_output=True, timeout=300, check=False,
        env={**os.environ, "PYTHONIOENCODING": "cp1252", "OMP_WAIT_POLICY": "PASSIVE"})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"Traceback" not in done.stderr
    # The model copies the pattern: characters cp1252 lacks, written as '?'.
    assert b"??" in done.stdout, done.stdout


def test_info_names_an_architecture_it_cannot_run_and_lists_those_it_can(tmp_path):
    """issue 52 item 5: a file of another architecture is described, refused in words, and
    the user learns which architectures would run."""
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    done = strata("info", str(path))
    assert done.returncode == 0, done.stderr
    assert "mamba (not supported by Strata)" in done.stdout
    runs = next(line for line in done.stdout.splitlines() if line.startswith("Strata runs:"))
    for arch in ("llama", "qwen3moe", "gemma3", "phi3"):
        assert arch in runs, runs
