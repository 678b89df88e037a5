"""`strata serve` with a model the tokenizer reads but the engine cannot load: one line and a
non-zero exit at start-up, not a server stuck in the failed state (issue 17 item 8)."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.server import server_command, server_env
from tests.text.spm_gguf import write_spm_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_model_that_cannot_load_exits_with_one_line(tmp_path) -> None:
    model = write_spm_gguf(tmp_path / "odd.gguf", arch="nosucharch")  # a vocabulary, no engine
    args = [*server_command(), "serve", "--model", str(model), "--port", "0",
            "--device", "cpu", "--snapshot-dir", str(tmp_path / "snapshots")]
    try:
        done = subprocess.run(args, check=False, capture_output=True, text=True,
                              timeout=150,
                              env=server_env(tmp_path))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"strata serve kept running with a model it cannot load:\n{exc.stderr}")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("strata: error:")]
    assert len(errors) == 1, done.stderr
    assert "cannot load the model" in errors[0] and "nosucharch" in errors[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert "serving" not in done.stderr  # it never claimed to serve
