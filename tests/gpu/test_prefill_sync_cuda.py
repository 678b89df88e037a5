"""A long prompt's prefill steps queue their chunks without waiting for the GPU: only the
step that samples the first token syncs. A synchronizing ids copy once made a prompt's
second step wait for all of the first step's kernels (docs/benchmarks.md, run 24). torch's
sync debug mode raises on any synchronizing call made in the checked steps."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.core.token_ids import ids_on
from strata.engine.protocol import SamplingSpec
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = pytest.mark.gpu


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 300 + 5 for j in range(length)]


def test_ids_on_queues_the_copy_without_a_sync() -> None:
    device = torch.device("cuda")
    torch.cuda._sleep(10_000_000)  # kernels still running when the ids are copied
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = ids_on([3, 1, 4, 1, 5], device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ids.device.type == "cuda" and ids.dtype == torch.long
    assert ids.tolist() == [3, 1, 4, 1, 5]


def test_the_prefill_steps_before_the_last_never_sync(tmp_path) -> None:
    path, _ = make_tiny_hf_model("llama", tmp_path)
    # 60 tokens in chunks of 16: three steps only prefill, the fourth samples the first token.
    engine = Engine(EngineConfig(model_path=str(path), device="cuda", num_slots=2,
                                 prefill_chunk_tokens=16, prefill_solo_chunk_tokens=0))
    engine.load()
    try:
        spec = SamplingSpec(max_tokens=3, temperature=0.0)
        for seed in (1, 2):  # capture and warm up on slot 0 what the checked steps run
            list(engine.generate(_prompt(seed, 60), spec, slot=0))
            engine.erase_slot(0)
        expected = [t for tokens in engine.generate(_prompt(3, 60), spec, slot=1)
                    for t in tokens]
        engine.erase_slot(1)
        engine.add("long", _prompt(3, 60), spec, 0)
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                events = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            # A sync inside the prefill fails the request: it would come back as an event.
            assert events == [], events
        got: list[int] = []
        while engine.has_work:
            got += [t for event in engine.step() for t in event.token_ids]
        assert got == expected
    finally:
        engine.close()
