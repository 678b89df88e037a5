"""Shared pieces of the snapshot tests: a long-context tiny llama, engines, cold references."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec

GREEDY = SamplingSpec(max_tokens=8, temperature=0.0)
VOCAB = 320
CONTEXT_TOKENS = 4096
# 2 layers x (k, v) x 2 kv heads x head_dim 16 x float32
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
SLOT_KV_BYTES = CONTEXT_TOKENS * KV_BYTES_PER_TOKEN


def save_tiny_llama(directory: Path, seed: int) -> Path:
    """A seeded random llama (hidden 64, 2 layers, GQA 4/2) whose positions reach 8192."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        # Wide weights keep greedy picks far from ties, so warm and cold runs agree exactly.
        initializer_range=0.25, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def make_engine(model_dir: Path, snapshot_dir: Path, **options) -> Engine:
    options.setdefault("context_tokens", CONTEXT_TOKENS)
    options.setdefault("device", "cpu")
    engine = Engine(EngineConfig(model_path=str(model_dir), snapshot_dir=str(snapshot_dir),
                                 **options))
    engine.load()
    return engine


def run(engine: Engine, prompt: list[int], slot: int = 0, spec: SamplingSpec = GREEDY) -> list[int]:
    return [t for ids in engine.generate(prompt, spec, slot=slot) for t in ids]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class ColdRunner:
    """Greedy answers of an engine whose slot holds nothing: the reference for warm runs."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, prompt: list[int]) -> list[int]:
        self.engine.erase_slot(0)
        answer = run(self.engine, prompt)
        assert self.engine.last_usage.cached_tokens == 0
        return answer


class Conversation:
    """A chat history on one slot: each turn appends the answer and a new user message."""

    def __init__(self, slot: int, seed: int, turn_tokens: int):
        self.slot = slot
        self.rng = random.Random(seed)
        self.turn_tokens = turn_tokens
        self.prompt: list[int] = []
        self.num_computed = 0  # tokens whose K/V the slot holds: prompt + all answers but the last

    def next_prompt(self, answer: list[int] | None) -> list[int]:
        self.prompt = self.prompt + (answer or []) + random_tokens(self.rng, self.turn_tokens)
        return self.prompt

    def turn(self, engine, cold, answer: list[int] | None) -> list[int]:
        prompt = self.next_prompt(answer)
        got = run(engine, prompt, self.slot)
        assert engine.last_usage.cached_tokens == self.num_computed
        assert got == cold(prompt)
        self.num_computed = len(prompt) + len(got) - 1
        return got


def locations(engine) -> dict[int, str]:
    return {row["id"]: row["location"] for row in engine.slots_status()}
