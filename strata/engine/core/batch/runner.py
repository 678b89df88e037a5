"""Runs the model for the scheduler: prefill chunks, the batched decode step, sampling.

On the GPU a sequence that decodes alone steps through the CUDA-graph decoder (fast/), and a
batch of B > 1 replays a graph per bucket of B (fast/batch_graph.py: padded to 1, 2, 4, 8 or
16 rows, each row attending over its own slot's KV by address); prompt chunks take the fast
prefill. Eager torch (`DecoderLM.forward_decode_batch`: linear layers on [B, hidden],
attention per sequence) on the CPU, and on the GPU where a step cannot live in a graph (the
MoE loop asks the host which experts run) or the batched attention kernels failed their
check. A partial expert cache batches in graphs too, reading through its slot table; its
promotion runs around each batch step as around a single sequence's.

Sampling stays per sequence (its own sampler, grammar, penalties, seed); the rows that are
plain greedy take one argmax over the batch, so a greedy step syncs with the host once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from strata.engine.core.batch.fast_stream import FastStream
from strata.engine.core.batch.sequence import Sequence
from strata.engine.core.quant.weight import compute_dtype
from strata.engine.core.sampling import Sampler
from strata.engine.core.snapshots.kv_state import SlotCache
from strata.engine.core.token_ids import ids_on
from strata.engine.protocol import SamplingSpec, TokenLogprob

log = logging.getLogger(__name__)

GrowKV = Callable[[SlotCache, int], None]
Sampled = tuple[int, TokenLogprob | None]


class BatchRunner:
    """The model side of a batch step; holds the graph decoder's stream while one is open."""

    def __init__(self, model: torch.nn.Module, fast, device: torch.device, vocab_size: int,
                 grow_kv: GrowKV, check_resident: Callable[[], None]):
        """fast: the GraphDecoder on CUDA, None elsewhere. grow_kv(cache, n) maps a slot's KV
        pages for n positions; check_resident raises when the model's memory is released."""
        self.model = model
        self._fast = fast
        self._batch = None  # fast/batch_graph.BatchDecoder, built on the first batch
        self._has_batch_decoder = False  # _batch was decided (it may be None: eager)
        self.device = device
        self.vocab_size = vocab_size
        self.grow_kv = grow_kv
        self.check_resident = check_resident
        self.stream: FastStream | None = None

    @property
    def fast(self):
        """The GraphDecoder, or None; a new one drops the batch decoder built over the old."""
        return self._fast

    @fast.setter
    def fast(self, decoder) -> None:
        self.close_stream()
        self._fast = decoder
        self.batch = None
        self._has_batch_decoder = False

    @property
    def batch(self):
        """The BatchDecoder that batches of B > 1 run through, or None: eager torch."""
        if not self._has_batch_decoder:
            self._batch = self._make_batch_decoder()
            self._has_batch_decoder = True
        return self._batch

    @batch.setter
    def batch(self, decoder) -> None:
        """Set by tests (an eager BatchDecoder on the CPU); None: eager torch."""
        if self._batch is not None:
            self._batch.clear()
        self._batch = decoder
        self._has_batch_decoder = True

    def _make_batch_decoder(self):
        fast = self._fast
        if fast is None or not fast.use_cuda_graphs:
            return None  # the CPU, or graphs off
        # Imported here, never on the CPU: their kernels decorate at import (Triton's
        # interpreter is chosen before, by a test).
        from strata.engine.core.fast.batch_attention import check_batch_attention
        from strata.engine.core.fast.batch_graph import BatchDecoder, is_capturable
        from strata.engine.core.fast.kernel_checks import attention_kinds

        if not is_capturable(self.model, fast.moe_impl):
            return None  # an MoE step that asks the host which experts run (the loop)

        problem = ""
        for attn in attention_kinds(self.model):  # each kernel variant: windowed or not
            problem = check_batch_attention(attn, compute_dtype(attn), self.device)  # KV's too
            if problem:
                break
        if problem:
            log.warning("batched decode attention kernels unusable (%s): batches run eagerly",
                        problem)
            return None
        return BatchDecoder(self.model, fast.ops, fast.moe_impl, use_cuda_graphs=True,
                            fused_attention=True, min_bucket_tokens=fast.min_bucket_tokens,
                            step_hook=fast.step_hook)

    def rebuild_batch_decoder(self) -> None:
        """Drop the batch decoder and its graphs; the next batch builds one again over the
        model as it is now (a live shrink gave its MoE layers a partial expert cache: the
        new one reads the slot table and calls the decoder's step hook)."""
        if self._batch is not None:
            self._batch.clear()
        self._batch = None
        self._has_batch_decoder = False

    def clear_graphs(self) -> None:
        """Drop the batch graphs and their pool (sleep); the next batch captures again."""
        if self._batch is not None:
            self._batch.clear()

    # ---- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Run prompt tokens after the sequence's cached ones; logits [V] of the last one."""
        self.check_resident()
        cache = seq.cache
        start = len(cache.tokens)
        ids = ids_on(token_ids, self.device)  # [T], queued: no wait for earlier chunks
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
        greedy = self._greedy_tokens(seqs, logits)
        results: list[Sampled | Exception] = []
        for b, seq in enumerate(seqs):
            if b in greedy:
                results.append((greedy[b], None))
                continue
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
    def _greedy_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> dict[int, int]:
        """Row -> token for the sequences that sample plain greedy (no grammar, penalty, bias
        or logprobs): one argmax and one host sync for all of them."""
        rows = [b for b, seq in enumerate(seqs)
                if seq.constraint is None and is_plain_greedy(seq.sampling)]
        if not rows:
            return {}
        for b in rows:
            if seqs[b].sampler is None:  # what the graph decoder takes over from later
                seqs[b].sampler = Sampler(seqs[b].sampling, self.device, self.vocab_size,
                                          [*seqs[b].prompt, *seqs[b].generated],
                                          seed_offset=len(seqs[b].generated))
        picked = logits if len(rows) == len(seqs) else logits[rows]
        return dict(zip(rows, torch.argmax(picked, dim=-1).tolist(), strict=True))

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed every pending token at its sequence's position; logits [B, V]."""
        self.check_resident()
        for seq in seqs:
            self.grow_kv(seq.cache, seq.position + 1)
        if len(seqs) > 1 and self.batch is not None:
            logits = self._forward_graphs(seqs)  # [B, V]
        elif len(seqs) == 1:
            # Alone (on the CPU, or graphs off): the per-sequence forward, as before batching.
            seq = seqs[0]
            ids = ids_on([seq.pending], self.device)  # [1]
            logits = self.model(ids, seq.position, seq.cache.kv, last_only=True)  # [1, V]
        else:
            ids = ids_on([seq.pending for seq in seqs], self.device)  # [B]
            logits = self.model.forward_decode_batch(
                ids, [seq.position for seq in seqs], [seq.cache.kv for seq in seqs])  # [B, V]
        for seq in seqs:
            seq.cache.tokens.append(seq.pending)
        return logits

    def _forward_graphs(self, seqs: list[Sequence]) -> torch.Tensor:
        """The batch decoder's step, in groups of its largest bucket; logits [B, V]."""
        from strata.engine.core.fast.batch_graph import MAX_BATCH_ROWS

        parts = []
        for first in range(0, len(seqs), MAX_BATCH_ROWS):
            group = seqs[first : first + MAX_BATCH_ROWS]
            logits = self.batch.forward([s.pending for s in group], [s.position for s in group],
                                        [s.cache.kv for s in group])  # a view of its buffer
            parts.append(logits if len(seqs) <= MAX_BATCH_ROWS else logits.clone())
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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


def is_plain_greedy(spec: SamplingSpec) -> bool:
    """Greedy with nothing that changes the logits or asks for more than the token."""
    return ((spec.temperature <= 0.0 or spec.top_k == 1) and not spec.has_penalties
            and not spec.logit_bias and spec.num_logprobs is None)
