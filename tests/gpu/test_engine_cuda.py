"""The engine on CUDA: bf16 logits track the float32 CPU ones, prefix reuse and greedy agree."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.kv_cache import KVCache
from strata.engine.protocol import SamplingSpec
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("gpu-models"))
    cpu = Engine(EngineConfig(model_path=str(path), device="cpu"))
    gpu = Engine(EngineConfig(model_path=str(path), device="cuda"))
    cpu.load(), gpu.load()
    return cpu, gpu


def run(engine: Engine, prompt, slot=0, n=20) -> list[int]:
    spec = SamplingSpec(max_tokens=n, temperature=0.0)
    return [t for ids in engine.generate(prompt, spec, slot=slot) for t in ids]


def test_cuda_logits_track_cpu(engines) -> None:
    cpu, gpu = engines
    assert gpu.info()["device"] == "cuda" and gpu.info()["dtype"] == "bfloat16"
    prompt = list(range(5, 45))
    config = cpu.model_config
    cpu_kv = KVCache.for_config(config, 64, torch.float32, "cpu")
    gpu_kv = KVCache.for_config(config, 64, torch.bfloat16, "cuda")
    with torch.inference_mode():
        ref = cpu.model(torch.tensor(prompt), 0, cpu_kv)
        got = gpu.model(torch.tensor(prompt, device="cuda"), 0, gpu_kv).float().cpu()
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1)  # [T]
    assert cosine.min() > 0.99, cosine
    top1_agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    assert top1_agreement >= 0.85


def test_cuda_prefix_reuse_matches_cold(engines) -> None:
    _, gpu = engines
    first = list(range(10, 60))
    answer = run(gpu, first, slot=1)
    second = first + answer + [3, 4]
    warm = run(gpu, second, slot=1)
    assert gpu.last_usage.cached_tokens == len(first) + len(answer) - 1
    cold = run(gpu, second, slot=2)
    assert gpu.last_usage.cached_tokens == 0
    assert warm == cold
