"""bench/diag_quant_model.py without a GPU: on the CPU the default model runs dequantized both
ways, so no quantized weight is listed and both runs answer alike (the script's exit code).
In a subprocess without TRITON_INTERPRET: other test modules set it for this process, and the
CPU then quantizes through the interpreter, which takes minutes over every weight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.child_env import child_env

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "diag_quant_model.py"


def test_both_engines_answer_alike_on_the_cpu(smollm2_gguf) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(smollm2_gguf),
                           "--device", "cpu", "--tokens", "1"],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr[-3000:])
    assert "0 weights failed" in out and "Paris" in out, out
    assert out.count("first token's top logprobs [(") == 2  # each run's top five
