"""Embeddings: a sequence's final hidden states (after the final norm), pooled to one vector.

Runs the loaded model eagerly over each sequence with a KV buffer of its own, so no cache slot
is read or written: an embedding never evicts a chat's cached prefix. The vectors are
L2-normalized, as OpenAI's are (cosine similarity is then a dot product).

An Embed runs as an EmbedJob, a few sequences per step of the engine loop (core/process.py), so
a chat decodes and a Cancel is read between steps (issue 51: 10,000 inputs held the engine for
400 s in one piece).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from strata.engine import protocol as p
from strata.engine.core.engine_errors import EngineError
from strata.engine.core.kv_cache import KVCache

# Tokens per forward: bounds the activations ([T, intermediate]) of a long input, as the
# engine's prefill does; the K/V of earlier chunks stay in the sequence's own buffer.
CHUNK_TOKENS = 512
# Tokens one EmbedJob step runs (at least one whole sequence): between steps the engine loop
# decodes its batch and reads Cancel, so this bounds what a chat waits per embedding step.
STEP_TOKENS = 512


@torch.inference_mode()
def final_hidden_states(model: Any, token_ids: torch.Tensor, start_pos: int,
                        kv: KVCache) -> torch.Tensor:
    """Hidden states [T, H] of token_ids [T] at start_pos.., with the model's final norm: the
    decoder's forward without the vocabulary projection. Writes those positions' K/V to kv."""
    positions = torch.arange(start_pos, start_pos + token_ids.shape[0], device=token_ids.device)
    ropes = model.layer_ropes(positions)  # per layer: cos, sin [T, D] (Gemma: two tables)
    h = model.embed(token_ids)  # [T, H] (Gemma scales it)
    for i, layer in enumerate(model.model.layers):
        h = layer(h, start_pos, kv.k[i], kv.v[i], *ropes[i])
    return model.model.norm(h)  # [T, H]


@torch.inference_mode()
def embed_sequence(model: Any, token_ids: Sequence[int], pooling: str, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """One sequence's pooled, L2-normalized embedding [1, H] (float32); pooling "none":
    every token's hidden state [T, H], not normalized (llama.cpp's pooling none)."""
    kv = KVCache.for_config(model.config, len(token_ids), dtype=dtype, device=device)
    total = torch.zeros(model.config.hidden_size, dtype=torch.float32, device=device)
    last = total
    rows = []
    for start in range(0, len(token_ids), CHUNK_TOKENS):
        chunk = torch.tensor(token_ids[start : start + CHUNK_TOKENS], dtype=torch.long,
                             device=device)  # [T]
        hidden = final_hidden_states(model, chunk, start, kv).float()  # [T, H]
        if pooling == "none":
            rows.append(hidden)
            continue
        total += hidden.sum(dim=0)
        last = hidden[-1]
    if pooling == "none":
        return torch.cat(rows)
    pooled = last if pooling == "last" else total / len(token_ids)
    return F.normalize(pooled, dim=0).unsqueeze(0)


def check_embed(command: p.Embed, vocab_size: int, max_tokens: int) -> None:
    """EngineError (bad_request) for a command the model cannot run."""
    if command.pooling not in p.POOLINGS:
        raise EngineError(f"pooling must be one of {', '.join(p.POOLINGS)}, "
                          f"not {command.pooling!r}")
    if not command.token_ids:
        raise EngineError("nothing to embed: send at least one sequence")
    for i, ids in enumerate(command.token_ids):
        if not ids:
            raise EngineError(f"sequence {i} is empty: send at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise EngineError(f"sequence {i} has token ids outside 0..{vocab_size - 1}")
        if len(ids) > max_tokens:
            raise EngineError(f"sequence {i} is {len(ids)} tokens, the context is "
                              f"{max_tokens}")


class EmbedJob:
    """One Embed in the engine loop: `step()` embeds the next sequences (about STEP_TOKENS
    tokens, at least one sequence) until `is_done`; num_tokens counts what has run."""

    def __init__(self, engine: Any, command: p.Embed):
        """EngineError when the command cannot run on this engine now."""
        model = engine.model
        if model is None:
            raise EngineError("no model is loaded: load one first")
        check_embed(command, model.config.vocab_size, engine.context_tokens)
        self.command = command
        self.next_index = 0
        self.num_tokens = 0

    @property
    def request_id(self) -> str:
        return self.command.request_id

    @property
    def is_done(self) -> bool:
        return self.next_index >= len(self.command.token_ids)

    def step(self, engine: Any) -> p.Embeddings:
        """The vectors of the next sequences, in order."""
        engine.memory.check_resident()  # asleep or experts released: an error, not a GPU fault
        sequences = self.command.token_ids
        start = end = self.next_index
        step_tokens = 0
        while end < len(sequences) and (end == start or
                                        step_tokens + len(sequences[end]) <= STEP_TOKENS):
            step_tokens += len(sequences[end])
            end += 1
        vectors = [embed_sequence(engine.model, ids, self.command.pooling, engine.device,
                                  engine.dtype) for ids in sequences[start:end]]
        stacked = torch.cat(vectors).cpu()  # [N, H] (none: [tokens, H]): one copy to the host
        engine.num_embed_forwards += sum(-(-len(ids) // CHUNK_TOKENS)  # a forward per chunk
                                         for ids in sequences[start:end])
        self.next_index, self.num_tokens = end, self.num_tokens + step_tokens
        return p.Embeddings(self.request_id, tuple(tuple(row) for row in stacked.tolist()),
                            step_tokens)


def embed(engine: Any, command: p.Embed) -> p.Embeddings:
    """Answer a whole Embed at once with the loaded Engine's model (tests and benchmarks; the
    engine loop runs an EmbedJob step by step); EngineError when it cannot run now."""
    job = EmbedJob(engine, command)
    vectors: list[tuple[float, ...]] = []
    while not job.is_done:
        vectors.extend(job.step(engine).vectors)
    return p.Embeddings(command.request_id, tuple(vectors), job.num_tokens)
