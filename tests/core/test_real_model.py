"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) through the in-process Engine.

Black-box checks a user would make first: the chat answer is right, text survives the
tokenizer, the chat template is SmolLM2's own, and a follow-up turn reuses the cache without
changing the greedy answer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from strata.engine.core.engine import Engine, EngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.text import IncrementalDetokenizer, TextAssets

QUESTION = "What is the capital of France?"
# SmolLM2-Instruct's template inserts this system turn when the conversation has none.
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
IM_START_ID, IM_END_ID = 1, 2  # <|im_start|>, <|im_end|> in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def model_path(smollm2_gguf: Path) -> Path:
    return smollm2_gguf


@pytest.fixture(scope="module")
def assets(smollm2: TextAssets) -> TextAssets:
    return smollm2


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Engine:
    # One thread: OpenMP's second thread spins while waiting, and on a 2-core CI machine shared
    # with other jobs that makes each decode step ~10x slower (the e2e server sets
    # OMP_WAIT_POLICY=PASSIVE instead, which must be set before torch loads).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A short context keeps the four slots' KV small; the prompts here are < 200 tokens.
    engine = Engine(EngineConfig(model_path=str(model_path), device="cpu", context_tokens=1024))
    engine.load()
    yield engine
    engine.close()
    torch.set_num_threads(num_threads)


def greedy(assets: TextAssets, max_tokens: int = 48) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0,
                        stop_token_ids=tuple(assets.eos_token_ids))


def answer(engine: Engine, assets: TextAssets, messages: list[dict], slot: int = 0) -> str:
    """The greedy reply to `messages`, decoded the way the server does (token by token)."""
    detokenizer = IncrementalDetokenizer(assets, skip_special=True)
    pieces = [detokenizer.push(ids) for ids in
              engine.generate(assets.encode_chat(messages), greedy(assets), slot=slot)]
    return "".join(pieces) + detokenizer.flush()


def test_loaded_model_is_smollm2_135m(engine: Engine) -> None:
    info = engine.info()
    assert info["model_type"] == "llama"
    # 134.5M parameters: 30 layers of 576 wide, tied embeddings of a 49152 vocabulary.
    assert 134_000_000 < info["parameter_count"] < 135_000_000
    assert engine.model_config.num_hidden_layers == 30
    assert engine.model_config.tie_word_embeddings


def test_capital_of_france_is_paris(engine: Engine, assets: TextAssets) -> None:
    reply = answer(engine, assets, [{"role": "user", "content": QUESTION}])
    assert "Paris" in reply, reply
    usage = engine.last_usage
    # It ends its turn by itself, with <|im_end|>, long before max_tokens.
    assert usage.finish_reason == "stop", usage
    assert usage.completion_tokens < 48


def test_follow_up_turn_reuses_the_cache_and_matches_a_cold_slot(
    engine: Engine, assets: TextAssets
) -> None:
    first = [{"role": "user", "content": QUESTION}]
    reply = answer(engine, assets, first, slot=1)
    follow_up = [*first, {"role": "assistant", "content": reply},
                 {"role": "user", "content": "And of Italy?"}]
    warm = answer(engine, assets, follow_up, slot=1)
    num_cached = engine.last_usage.cached_tokens
    # At least the whole first prompt is reused (the reply may re-tokenize differently).
    assert num_cached >= len(assets.encode_chat(first)), engine.last_usage
    cold = answer(engine, assets, follow_up, slot=2)
    assert engine.last_usage.cached_tokens == 0
    assert warm == cold
    assert "Rome" in warm, warm


@pytest.mark.parametrize("text", [
    "Crème brûlée à Zürich, naïve café, Ærøskøbing, ñandú",
    "東京タワーと富士山、北京烤鸭，서울 특별시",
    "Emoji: 🗼🎉👩‍👩‍👧‍👦 🇫🇷 and a flag, ✔︎ done",
    "mixed: e\u0301 (combining) vs é, tabs\tand\nnewlines  double  spaces",
])
def test_tokenizer_round_trips_unicode(assets: TextAssets, text: str) -> None:
    ids = assets.encode(text)
    assert assets.decode(ids) == text
    # Streamed one token at a time, as the server does, no half character ever shows up.
    detokenizer = IncrementalDetokenizer(assets)
    pieces = [detokenizer.push([token]) for token in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Multi-byte characters really were split over byte tokens, so the check above had work.
    if any(ord(ch) > 0x7FF for ch in text):
        assert any(assets.decode([token]).endswith("\ufffd") for token in ids)


def test_chat_template_renders_system_user_assistant_like_smollm2(assets: TextAssets) -> None:
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Italy?"},
    ]
    # SmolLM2-Instruct's template is ChatML: one <|im_start|>ROLE\n...<|im_end|>\n per turn.
    expected = (
        "<|im_start|>system\nAnswer in one word.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n"
        "<|im_start|>user\nAnd Italy?<|im_end|>\n"
    )
    assert assets.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert assets.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    ids = assets.encode_chat(messages)
    # The role markers are single control tokens, not spelled out in pieces.
    assert ids.count(IM_START_ID) == 5 and ids.count(IM_END_ID) == 4
    assert ids[0] == IM_START_ID
    assert assets.decode(ids, skip_special=False) == expected + "<|im_start|>assistant\n"
    # <|im_end|> ends the assistant's turn, so it must stop generation.
    assert IM_END_ID in assets.eos_token_ids


def test_chat_template_adds_smollm2_default_system_turn(assets: TextAssets) -> None:
    text = assets.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == (f"<|im_start|>system\n{SMOLLM2_DEFAULT_SYSTEM}<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
