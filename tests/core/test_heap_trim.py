"""The engine gives a long prompt's freed activations back to the OS once it goes idle
(memory/heap_trim.py; issue 51 item 8: 1.79 GB stayed resident after one 7,230-token prompt).

Measured on the real engine process (CPU, a random llama wide enough that its activations come
from the C heap; 4,000 tokens): without the trim all of the prompt's 220 MiB peak stayed
resident, with it 34 MiB (the KV it wrote and allocator slack)."""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from strata.engine import protocol as p
from strata.engine.core.engine import EngineConfig
from strata.engine.core.memory.heap_trim import trim_heap
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY
from tests.helpers.engine_pipe import EnginePipe

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")


def save_wide_llama(directory) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        directory)


@linux_only
def test_trim_heap_returns_freed_pages() -> None:
    # Mid-sized blocks freed after a large one stay in glibc's heap until trimmed.
    import torch

    process = psutil.Process()
    blocks = [torch.empty(512, 1536).fill_(1.0) for _ in range(200)]  # 3 MiB each, 600 MiB
    held = process.memory_info().rss
    del blocks
    kept = process.memory_info().rss
    assert trim_heap()
    trimmed = process.memory_info().rss
    assert trimmed < kept - (held - kept) // 4 or kept < held - 400 * 2**20, (held, kept, trimmed)


@linux_only
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_process_trims_after_a_long_prompt(tmp_path) -> None:
    model_dir = tmp_path / "model"
    save_wide_llama(model_dir)
    config = EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=8192,
                          snapshot_dir=str(tmp_path / "snapshots"))
    engine = EnginePipe(DEFAULT_ENGINE_FACTORY, config)
    process = psutil.Process(engine.process.pid)
    try:
        loaded = engine.ask(p.Load(str(model_dir), 8192, "cpu"))
        assert isinstance(loaded, p.Reply), loaded
        time.sleep(0.5)
        before = process.memory_info().rss
        prompt = tuple((7 * i) % 300 + 5 for i in range(4000))
        engine.conn.send(p.Envelope(0, p.Generate("g", prompt, p.SamplingSpec(max_tokens=4))))
        peak = before
        while True:
            if engine.conn.poll(0.02):
                event = engine.conn.recv()
                assert not isinstance(event, p.Error), event
                if isinstance(event, p.Done):
                    break
            peak = max(peak, process.memory_info().rss)
        time.sleep(1.0)  # the loop trims as it goes idle, right after the Done
        after = process.memory_info().rss
    finally:
        engine.close()
    grown_mib, kept_mib = (peak - before) / 2**20, (after - before) / 2**20
    assert grown_mib > 50, f"the prompt grew the engine by only {grown_mib:.0f} MiB"
    assert kept_mib < 0.5 * grown_mib, (
        f"{kept_mib:.0f} of the prompt's {grown_mib:.0f} MiB stayed resident once idle")
