"""Runs the model for the scheduler: prefill chunks, the batched decode step, sampling.

Eager torch on the CPU and for a batch on the GPU (`DecoderLM.forward_decode_batch`: linear
layers on [B, hidden], attention per sequence); the CUDA-graph decoder (fast/) for a sequence
that decodes alone, and its fused prefill for every prompt chunk on the GPU.

Not yet: CUDA graphs for a batch. A batch of B > 1 on the GPU runs eagerly, the host launching
every kernel of the step and the MoE loop asking which experts run. The next step is a graph
per bucket of B (1, 2, 4, 8, 16) over static token/position buffers and a batched decode
attention that reads each row's own KV range by address, in a file of its own beside
fast/decode_graph.py, chosen here when B > 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from strata.engine.core.batch.fast_stream import FastStream
from strata.engine.core.batch.sequence import Sequence
from strata.engine.core.sampling import Sampler
from strata.engine.core.snapshots.kv_state import SlotCache
from strata.engine.protocol import TokenLogprob

GrowKV = Callable[[SlotCache, int], None]
Sampled = tuple[int, TokenLogprob | None]


class BatchRunner:
    """The model side of a batch step; holds the graph decoder's stream while one is open."""

    def __init__(self, model: torch.nn.Module, fast, device: torch.device, vocab_size: int,
                 grow_kv: GrowKV, check_resident: Callable[[], None]):
        """fast: the GraphDecoder on CUDA, None elsewhere. grow_kv(cache, n) maps a slot's KV
        pages for n positions; check_resident raises when the model's memory is released."""
        self.model = model
        self.fast = fast
        self.device = device
        self.vocab_size = vocab_size
        self.grow_kv = grow_kv
        self.check_resident = check_resident
        self.stream: FastStream | None = None

    # ---- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Run prompt tokens after the sequence's cached ones; logits [V] of the last one."""
        self.check_resident()
        cache = seq.cache
        start = len(cache.tokens)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [T]
        if self.fast is not None:
            # A fresh prompt replayed from a prefill graph writes K/V over its whole bucket.
            reach = self.fast.prefill_reach(cache.kv, len(token_ids), start)
            self.grow_kv(cache, max(start + len(token_ids), reach))
            logits = self.fast.prefill(cache.kv, ids, start)  # [V]
        else:
            self.grow_kv(cache, start + len(token_ids))
            logits = self.model(ids, start, cache.kv, last_only=True)[-1]  # [V]
        cache.tokens.extend(token_ids)
        return logits

    @torch.inference_mode()
    def sample_first(self, seq: Sequence, logits: torch.Tensor, is_alone: bool) -> Sampled:
        """The first token from the prompt's logits [V]. A sequence alone on the GPU (no other
        runs, so no other's state is in the graph sampler) samples with the graph decoder's
        sampler, whose state its decode steps then continue, as before batching."""
        if seq.constraint is not None:
            logits = seq.constraint.mask(logits)
        if self.fast is not None and is_alone:
            self.close_stream()  # the graph sampler is about to take this sequence's state
            token = self.fast.sample_first(logits, seq.sampling, seq.cache.tokens)
            record = self.fast.last_logprob
            seq.sampler = None
        else:
            token, record = self._sample(seq, logits)
        if seq.constraint is not None:
            seq.constraint.consume(token)
        return token, record

    # ---- decode -----------------------------------------------------------------------------

    def decode(self, seqs: list[Sequence]) -> list[Sampled | Exception]:
        """One decode step: feed each sequence's pending token, sample its next one.

        A sequence that decodes alone on the GPU steps through the graph decoder (other
        sequences may be prefilling: prefill leaves the decoder's state alone); otherwise one
        batched forward for all. Raises when the forward fails (all of them fail); a failure of
        one sequence's sampling (its grammar) comes back in its place in the list."""
        if self.fast is not None and len(seqs) == 1:
            seq = seqs[0]
            if self.stream is None or self.stream.seq is not seq:
                self.close_stream()
                self.stream = FastStream(self.fast, seq, self.grow_kv)
            return [self.stream.next_token()]
        self.close_stream()
        logits = self._forward(seqs)  # [B, V]
        results: list[Sampled | Exception] = []
        for b, seq in enumerate(seqs):
            try:
                step_logits = logits[b]
                if seq.constraint is not None:
                    step_logits = seq.constraint.mask(step_logits)
                token, record = self._sample(seq, step_logits)
                if seq.constraint is not None:
                    seq.constraint.consume(token)
                results.append((token, record))
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the others go on
                results.append(exc)
        return results

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every pending token at its sequence's position; logits [B, V]."""
        self.check_resident()
        for seq in seqs:
            self.grow_kv(seq.cache, seq.position + 1)
        ids = torch.tensor([seq.pending for seq in seqs], dtype=torch.long,
                           device=self.device)  # [B]
        if len(seqs) == 1:
            # Alone (on the CPU, or graphs off): the per-sequence forward, as before batching.
            seq = seqs[0]
            logits = self.model(ids, seq.position, seq.cache.kv, last_only=True)  # [1, V]
        else:
            logits = self.model.forward_decode_batch(
                ids, [seq.position for seq in seqs], [seq.cache.kv for seq in seqs])  # [B, V]
        for seq in seqs:
            seq.cache.tokens.append(seq.pending)
        return logits

    @torch.inference_mode()
    def _sample(self, seq: Sequence, logits: torch.Tensor) -> Sampled:
        if seq.sampler is None:
            # First eager draw, or the graph sampler had the sequence until now.
            seq.sampler = Sampler(seq.sampling, self.device, self.vocab_size,
                                  [*seq.prompt, *seq.generated], seed_offset=len(seq.generated))
        token = int(seq.sampler(logits))
        return token, seq.sampler.last_logprob

    # ---- the graph decoder's stream ---------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        """The sequence ended or leaves: stop its graph stream if it has one."""
        if self.stream is not None and self.stream.seq is seq:
            self.close_stream()

    def close_stream(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.close()
