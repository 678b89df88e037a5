"""A torch-free engine with the real Engine's interface, for tests of the process and service.

Tokens are deterministic: the i-th new token is (sum(prompt) + i) % vocab_size, so a test can
compute the expected stream. Prompts containing CRASH_TOKEN or RAISE_TOKEN fail on demand after
the first new token: the process dies with exit code 1, or the engine raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from strata.engine.protocol import SamplingSpec, Usage

CRASH_TOKEN = 999_999  # the engine process calls os._exit(1) after the first new token
RAISE_TOKEN = 999_998  # generate raises RuntimeError after the first new token
CRASH_EXIT_CODE = 1


@dataclass(frozen=True)
class FakeEngineConfig:
    """EngineConfig's fields plus knobs that shape the fake's behaviour."""

    model_path: str = "fake-model"
    device: str = "cpu"
    context_tokens: int = 0  # 0: 4096
    vocab_size: int = 512
    token_delay_s: float = 0.0  # sleep before each new token, to make streams observable
    load_delay_s: float = 0.0
    crash_on_load: bool = False  # the process exits with code 3 inside load()
    fail_on_load: bool = False  # load() raises ValueError (a bad model file)
    eos_token_id: int | None = None


def expected_tokens(prompt_ids: Sequence[int], max_tokens: int, vocab_size: int = 512) -> list[int]:
    """The tokens FakeEngine generates for a prompt when no stop or EOS token interferes."""
    base = sum(prompt_ids)
    return [(base + i) % vocab_size for i in range(max_tokens)]


class FakeEngine:
    """Engine interface (load, generate, status, close, last_usage) without a model."""

    def __init__(self, config: FakeEngineConfig):
        self.config = config
        self.is_loaded = False
        self.last_usage: Usage | None = None
        self.slot_tokens: dict[int, list[int]] = {}
        self.context_tokens = config.context_tokens or 4096

    def load(self) -> dict:
        if self.config.crash_on_load:
            os._exit(3)
        if self.config.fail_on_load:
            raise ValueError(f"{self.config.model_path} is not a model file (fake failure)")
        time.sleep(self.config.load_delay_s)
        self.is_loaded = True
        return self.info()

    def info(self) -> dict:
        return {
            "model_type": "fake",
            "context_tokens": self.context_tokens,
            "device": "cpu",
            "dtype": "none",
            "parameter_count": 0,
        }

    def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingSpec, slot: int = 0
    ) -> Iterator[list[int]]:
        if not self.is_loaded:
            raise RuntimeError("generate before load")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty: send at least one token")
        history = self.slot_tokens.get(slot, [])
        num_cached = 0
        while num_cached < min(len(history), len(prompt) - 1) and history[num_cached] == prompt[num_cached]:
            num_cached += 1
        stop_ids = set(sampling.stop_token_ids)
        if self.config.eos_token_id is not None:
            stop_ids.add(self.config.eos_token_id)
        generated: list[int] = []
        finish_reason = "cancelled"
        try:
            for token in expected_tokens(prompt, sampling.max_tokens, self.config.vocab_size):
                if generated and CRASH_TOKEN in prompt:
                    os._exit(CRASH_EXIT_CODE)
                if generated and RAISE_TOKEN in prompt:
                    raise RuntimeError("fake engine failure on request")
                time.sleep(self.config.token_delay_s)
                generated.append(token)
                yield [token]
                if token in stop_ids:
                    finish_reason = "stop"
                    break
            else:
                finish_reason = "length"
        finally:
            self.slot_tokens[slot] = prompt + generated
            self.last_usage = Usage(len(prompt), len(generated), num_cached, finish_reason)

    def status(self) -> dict:
        if not self.is_loaded:
            return {"state": "unloaded"}
        slots = {slot: {"tokens": len(t)} for slot, t in sorted(self.slot_tokens.items())}
        return {"state": "loaded", **self.info(), "slots": slots}

    def close(self) -> None:
        self.is_loaded = False
        self.slot_tokens.clear()


FAKE_ENGINE_FACTORY = f"{__name__}:FakeEngine"
