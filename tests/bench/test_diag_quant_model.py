"""bench/diag_quant_model.py without a GPU: on the CPU the default model runs dequantized both
ways, so no quantized weight is listed and both runs answer alike (the script's exit code)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_quant_model


def test_both_engines_answer_alike_on_the_cpu(smollm2_gguf, capsys) -> None:
    code = diag_quant_model.main(["--model", str(smollm2_gguf), "--device", "cpu",
                                  "--tokens", "1"])
    out = capsys.readouterr().out
    assert "0 weights failed" in out and "Paris" in out, out
    assert code == 0
    assert out.count("first token's top logprobs [(") == 2  # each run's top five
