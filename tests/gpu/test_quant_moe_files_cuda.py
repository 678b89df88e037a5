"""Qwen3-30B-A3B-shaped MoE files in the peer benchmarks' mixes (bench/gguf_mix.py), 8 of 48
layers, load and decode on the GPU: every expert kernel at the real shapes (128 experts,
[768, 2048] and [2048, 768]) and the mixes' per-layer types, with all candidate tiles the
load's warm-up autotunes.

Why: run 17's IQ2_XXS file (ffn_down Q2_K in the first eighth of the layers, IQ2_XXS after)
failed its load with an illegal memory access in the expert warm-up, which no kernel test at
smaller shapes or with one tile had met. The engine runs in a subprocess with
CUDA_LAUNCH_BLOCKING=1, so a fault names the kernel that made it and cannot poison this
process's CUDA context.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from random_gguf import write_random_gguf

from tests.helpers.child_env import child_env

pytestmark = pytest.mark.gpu

NUM_LAYERS = 8  # gguf_mix: layer 0 keeps the first eighth's types (ffn_down Q2_K for IQ2_XXS)

SCRIPT = textwrap.dedent("""
    import sys
    from strata.engine.core.engine import Engine, EngineConfig
    from strata.engine.protocol import SamplingSpec
    engine = Engine(EngineConfig(model_path=sys.argv[1], device="cuda", context_tokens=1024))
    engine.load()
    spec = SamplingSpec(max_tokens=8, temperature=0.0)
    prompt = list(range(100, 140))
    tokens = [t for step in engine.generate(prompt, spec) for t in step]
    assert len(tokens) == 8, tokens
    print("tokens", tokens)
    engine.close()
""")


@pytest.mark.parametrize("mix", ["IQ2_XXS", "Q8_0"])  # Q4_K_M: every peer run loads it
def test_cuda_moe_file_of_the_mix_loads_and_decodes(mix: str, tmp_path) -> None:
    path = tmp_path / f"qwen3-30b-a3b-{NUM_LAYERS}L-{mix}.gguf"
    write_random_gguf("qwen3-30b-a3b", path, mix=mix, num_layers=NUM_LAYERS)
    env = child_env(CUDA_LAUNCH_BLOCKING="1", STRATA_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    assert "tokens" in done.stdout
