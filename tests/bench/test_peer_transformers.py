"""bench/peer_transformers.py on the CPU: the real transformers peer runs a tiny MoE with its
experts as grouped GEMMs and reports its figures, as `strata bench` reads them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
}


def peer(tmp_path: Path, *extra: str) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MOE))
    done = subprocess.run(
        [sys.executable, str(BENCH / "peer_transformers.py"), "--model", str(config),
         "--device", "cpu", "--no-compile", "--prefill-tokens", "64", "--prompt-tokens", "16",
         "--decode-tokens", "4", *extra],
        capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEER_JSON ")]
    return json.loads(lines[-1][len("PEER_JSON "):])


def test_an_moe_peer_runs_grouped_experts(tmp_path: Path) -> None:
    result = peer(tmp_path)
    assert result["experts"] == "grouped_mm", result
    assert result["prefill_tok_s"] > 0 and result["ttft_ms"] > 0 and not result["compiled"]


def test_an_unknown_experts_implementation_is_the_rows_error(tmp_path: Path) -> None:
    result = peer(tmp_path, "--experts-implementation", "no-such-kernel")
    assert "no-such-kernel" in result["error"], result
