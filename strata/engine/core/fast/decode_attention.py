"""One token's attention in two Triton launches instead of seven small torch kernels.

The torch decode attention is q/k norm+RoPE (2 kernels), two `index_copy_` into the cache,
QK^T, masked softmax, PV: seven launches a layer, together costing as much as reading the
layer's weights (figures: docs/benchmarks.md, "Figures behind the fast path"). Here:

1. `_split_kernel`, grid (kv heads, key splits): every program norms and rotates its query
   group and the new key itself (a few hundred FLOPs), scans SPLIT_KEYS cache slots with an
   online softmax, and writes (max, sum, weighted values) for its split. Its first block of
   cached keys loads before the PDL wait, and each block's successor while it is used. The
   new K/V row is stored by split 0 and substituted in registers by every split, so no
   program ever reads a slot another one is writing. Splits past the position load nothing
   (masked loads).
2. `_combine_kernel`, grid (query heads,): merges the splits (flash-decoding). For o_proj's
   dp4a product (`fused_decode_attention_rounded`) it also rounds its head's values to int8
   per 32, as gemv_dp4a.quantize_x would in a launch of its own (fast/decode_rounded.py).

Per layer, at compile time (constexprs, so a plain layer's kernels are unchanged): Gemma's
(1 + w) q/k norms and own query scale; a sliding window (Gemma 3's local layers, GPT-OSS's
alternate ones), whose slots outside the window are never loaded; GPT-OSS's sinks, one logit
per query head that joins the combine's denominator.

`reference_decode_attention` is the torch twin (and the path when Triton cannot run);
`check_fused` compares the two once on the real device before a decoder trusts the kernels.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from strata.engine.core.fast.pointwise import (
    EAGER_OPS,
    PointwiseOps,
    attention_scale,
    attention_sinks,
    attention_window,
    attn_qk_norm_rope,
    is_unit_offset,
)
from strata.engine.core.kernels import launch, pdl
from strata.engine.core.quant.gemv_dp4a import X_GROUP, empty_rounding, quantize_x
from strata.engine.core.quant.weight import compute_dtype

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.gemv_dp4a import round_and_store
except ImportError:  # optional: the reference path needs only torch
    triton = None

BLOCK_KEYS = 64  # keys per inner step; >= 16 for tl.dot on the GPU
MAX_SPLITS = 128  # the combine kernel holds [splits, D] in registers


if triton is not None:
    # A split that saw no key: finite, so exp(m - m) never computes inf - inf.
    _EMPTY_MAX = tl.constexpr(-1.0e30)

    @triton.jit
    def _norm_rope(x, xp, w_ptr, cols, partner, cos, sin, HAS_NORM: tl.constexpr, eps,
                   HEAD_DIM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
        # x [R, D] float32 and xp its RoPE partner columns (d + D/2) % D; returns rotated rows.
        # UNIT_OFFSET: Gemma's q/k norm scales by 1 + w.
        if HAS_NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
            w = tl.load(w_ptr + cols).to(tl.float32)
            wp = tl.load(w_ptr + partner).to(tl.float32)
            if UNIT_OFFSET:
                w = w + 1.0
                wp = wp + 1.0
            x = x * rstd[:, None] * w[None, :]
            xp = xp * rstd[:, None] * wp[None, :]
        sign = tl.where(cols < HEAD_DIM // 2, -1.0, 1.0)
        return x * cos[None, :] + sign[None, :] * xp * sin[None, :]

    @triton.jit
    def _cached_keys(k_cache, v_cache, keys, pos, head, cols, stride_token, NUM_KEYS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr):
        """This kv head's cached K and V rows of slots `keys` [BLOCK_S] before pos (and inside
        the window, if any), zeros for the others (the slot at pos is this step's, the later
        ones unused): [BLOCK_S, D]."""
        kv_off = keys[:, None].to(tl.int64) * stride_token + head * HEAD_DIM + cols[None, :]
        ok = (keys < pos) & (keys < NUM_KEYS)
        if WINDOW > 0:  # slots the window has left are never read
            ok = ok & (keys > pos - WINDOW)
        ok = ok[:, None]
        return (tl.load(k_cache + kv_off, mask=ok, other=0.0),
                tl.load(v_cache + kv_off, mask=ok, other=0.0))

    @triton.jit
    def _split_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, k_cache, v_cache, pos_ptr,
        max_ptr, sum_ptr, acc_ptr, eps, scale, stride_token,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HAS_NORM: tl.constexpr, NUM_KEYS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr,
        UNIT_OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    ):
        head = tl.program_id(0)
        split = tl.program_id(1)
        # Before the PDL wait only what no kernel of this layer writes (pdl.py): the
        # position and the rotary angles (set before the step's first kernel) and the cache
        # slots before the position (earlier steps wrote them), so this split's first keys
        # stream while the projection before still runs.
        pos = tl.load(pos_ptr)
        cols = tl.arange(0, HEAD_DIM)
        partner = (cols + HEAD_DIM // 2) % HEAD_DIM
        cos = tl.load(cos_ptr + cols).to(tl.float32)
        sin = tl.load(sin_ptr + cols).to(tl.float32)
        kb, vb = _cached_keys(k_cache, v_cache, split * SPLIT_KEYS + tl.arange(0, BLOCK_S), pos,
                              head, cols, stride_token, NUM_KEYS, HEAD_DIM, WINDOW)
        pdl_wait(USE_PDL)  # q, k, v come from the projection just before (pdl.py)
        one = tl.arange(0, 1)
        # The new key and value of this kv head, [1, D].
        k_off = (head + one)[:, None] * HEAD_DIM
        k_new = _norm_rope(tl.load(k_ptr + k_off + cols[None, :]).to(tl.float32),
                           tl.load(k_ptr + k_off + partner[None, :]).to(tl.float32),
                           kn_ptr, cols, partner, cos, sin, HAS_NORM, eps, HEAD_DIM,
                           UNIT_OFFSET)
        k_new = k_new.to(k_cache.dtype.element_ty)
        v_new = tl.load(v_ptr + k_off + cols[None, :]).to(v_cache.dtype.element_ty)
        if split == 0:
            slot = pos * stride_token + k_off + cols[None, :]
            tl.store(k_cache + slot, k_new)
            tl.store(v_cache + slot, v_new)
        # The group's queries, [GROUP_PAD, D] (padding rows are zeros and never stored).
        g = tl.arange(0, GROUP_PAD)
        g_ok = g < GROUP
        q_off = (head * GROUP + g)[:, None] * HEAD_DIM
        q_rows = tl.load(q_ptr + q_off + cols[None, :], mask=g_ok[:, None], other=0.0)
        q_partners = tl.load(q_ptr + q_off + partner[None, :], mask=g_ok[:, None], other=0.0)
        q = _norm_rope(q_rows.to(tl.float32), q_partners.to(tl.float32),
                       qn_ptr, cols, partner, cos, sin, HAS_NORM, eps, HEAD_DIM, UNIT_OFFSET)
        q = (q * scale).to(k_cache.dtype.element_ty)
        m_i = tl.full([GROUP_PAD], _EMPTY_MAX, tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for offset in range(0, SPLIT_KEYS, BLOCK_S):
            keys = split * SPLIT_KEYS + offset + tl.arange(0, BLOCK_S)
            if SPLIT_KEYS > BLOCK_S:  # the next block's slots load while this one is used
                upcoming = tl.where(offset + BLOCK_S < SPLIT_KEYS, keys + BLOCK_S, NUM_KEYS)
                next_kb, next_vb = _cached_keys(k_cache, v_cache, upcoming, pos, head, cols,
                                                stride_token, NUM_KEYS, HEAD_DIM, WINDOW)
            else:  # one block a split (buckets up to 8192 keys): nothing to load ahead
                next_kb, next_vb = kb, vb
            valid = (keys <= pos) & (keys < NUM_KEYS)
            if WINDOW > 0:  # Gemma 3's local layers, GPT-OSS's alternate ones
                valid = valid & (keys > pos - WINDOW)
            fresh = keys[:, None] == pos  # the slot this step writes: use the registers
            kb = tl.where(fresh, k_new, kb)
            vb = tl.where(fresh, v_new, vb)
            s = tl.dot(q, tl.trans(kb))  # [GROUP_PAD, BLOCK_S] float32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
            kb = next_kb
            vb = next_vb
        row = (head * GROUP + g) * NUM_SPLITS + split
        tl.store(max_ptr + row, m_i, mask=g_ok)
        tl.store(sum_ptr + row, l_i, mask=g_ok)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + cols[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def merge_splits(m, sums, sink_ptr, head, HAS_SINKS: tl.constexpr):
        """(weight per split, denominator) of the splits' (max, sum) statistics; with sinks,
        the head's sink logit joins the denominator (GPT-OSS)."""
        # The split holding the position saw a key, so the max is finite.
        top = tl.max(m, axis=0)
        if HAS_SINKS:
            sink = tl.load(sink_ptr + head).to(tl.float32)
            top = tl.maximum(top, sink)
        w = tl.exp(m - top)
        total = tl.sum(w * sums, axis=0)
        if HAS_SINKS:
            total += tl.exp(sink - top)
        return w, total

    @triton.jit
    def _combine_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, q_ptr, d_ptr, s_ptr, sink_ptr,
                        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        BLOCK_SPLITS: tl.constexpr, ROUND: tl.constexpr,
                        HAS_SINKS: tl.constexpr, USE_PDL: tl.constexpr):
        head = tl.program_id(0)
        pdl_wait(USE_PDL)
        splits = tl.arange(0, BLOCK_SPLITS)
        ok = splits < NUM_SPLITS
        cols = tl.arange(0, HEAD_DIM)
        rows = head * NUM_SPLITS + splits
        m = tl.load(max_ptr + rows, mask=ok, other=_EMPTY_MAX)
        w, total = merge_splits(m, tl.load(sum_ptr + rows, mask=ok, other=0.0), sink_ptr, head,
                                HAS_SINKS)
        acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None],
                      other=0.0)
        out = (tl.sum(w[:, None] * acc, axis=0) / total).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + head * HEAD_DIM + cols, out)
        if ROUND:  # the head's groups of 32, as quantize_x rounds the stored values
            round_and_store(tl.reshape(out.to(tl.float32), (HEAD_DIM // 32, 32)),
                            head * (HEAD_DIM // 32) + tl.arange(0, HEAD_DIM // 32),
                            tl.num_programs(0) * (HEAD_DIM // 32), q_ptr, d_ptr, s_ptr)


def is_usable(device: torch.device) -> bool:
    """Triton importable and this device able to run it (CUDA, or the CPU interpreter)."""
    return triton is not None and launch.is_usable(device)


def split_plan(num_keys: int) -> tuple[int, int]:
    """(keys per split, number of splits) for a bucket of num_keys slots: at most MAX_SPLITS."""
    per_split = BLOCK_KEYS
    while -(-num_keys // per_split) > MAX_SPLITS:
        per_split *= 2
    return per_split, -(-num_keys // per_split)


def fused_decode_attention(attn, q, k, v, cos, sin, k_cache, v_cache, position, key_positions,
                           use_pdl: bool = False):
    """Attention of one token over cache slots 0..S-1 (masked past position); [1, Hq*D].

    key_positions [S] is 0..S-1 (only its length is used here: S is a compile-time bound).
    q [1, Hq*D], k/v [1, Hkv*D] straight from the projections (norm and RoPE happen inside);
    cos/sin [1, D] float32; caches [S, Hkv, D] contiguous; writes K/V at `position` [1].
    use_pdl: launch both kernels as PDL secondaries (pdl.py).
    """
    return _attention(attn, q, k, v, cos, sin, k_cache, v_cache, position, key_positions,
                      use_pdl, False)[0]


def rounds_output(attn, dtype: torch.dtype) -> bool:
    """Whether fused_decode_attention_rounded can round this layer's output: bf16/fp16, and
    heads of whole groups of 32."""
    return dtype in (torch.bfloat16, torch.float16) and attn.head_dim % X_GROUP == 0


def fused_decode_attention_rounded(attn, q, k, v, cos, sin, k_cache, v_cache, position,
                                   key_positions, use_pdl: bool = False) -> tuple:
    """(out, (q8, d, s)): fused_decode_attention's out [1, Hq*D] and its int8 rounding as
    gemv_dp4a.quantize_x(out) gives it, made by the kernel that makes out (rounds_output)."""
    if not rounds_output(attn, q.dtype):
        raise ValueError(f"the attention output rounds to int8 in bf16/fp16 heads of a multiple "
                         f"of {X_GROUP} values, not {q.dtype} heads of {attn.head_dim}")
    return _attention(attn, q, k, v, cos, sin, k_cache, v_cache, position, key_positions,
                      use_pdl, True)


def _attention(attn, q, k, v, cos, sin, k_cache, v_cache, position, key_positions,
               use_pdl: bool, round_out: bool) -> tuple:
    """(out, rounding or None): the split and combine launches."""
    num_keys = key_positions.shape[0]
    head_dim, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    if head_dim & (head_dim - 1) or k_cache.dtype != q.dtype or not k_cache.is_contiguous():
        raise ValueError(f"fused decode attention needs a power-of-two head_dim and contiguous "
                         f"caches in the activation dtype, got D={head_dim}, {k_cache.dtype}")
    per_split, num_splits = split_plan(num_keys)
    num_heads = attn.num_heads
    stats = torch.empty(2, num_heads, num_splits, dtype=torch.float32, device=q.device)
    acc = torch.empty(num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    out = torch.empty(1, num_heads * head_dim, dtype=q.dtype, device=q.device)
    norm = kernel_norm(attn, q)
    sinks = attention_sinks(attn)
    _split_kernel[(attn.num_kv_heads, num_splits)](
        q.contiguous(), k.contiguous(), v.contiguous(), cos.contiguous(), sin.contiguous(),
        norm.q_weight, norm.k_weight, k_cache, v_cache, position, stats[0], stats[1], acc,
        norm.eps, attention_scale(attn), k_cache.stride(0), HEAD_DIM=head_dim, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HAS_NORM=norm.has_norm,
        NUM_KEYS=num_keys, SPLIT_KEYS=per_split, NUM_SPLITS=num_splits, BLOCK_S=BLOCK_KEYS,
        UNIT_OFFSET=norm.unit_offset, WINDOW=attention_window(attn),
        **pdl.launch_options(use_pdl),
    )
    rounded = empty_rounding(1, out.shape[1], out.device) if round_out else None
    _combine_kernel[(num_heads,)](stats[0], stats[1], acc, out,
                                  *(rounded if rounded is not None else (out, out, out)),
                                  sinks if sinks is not None else out,
                                  HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
                                  BLOCK_SPLITS=triton.next_power_of_2(num_splits),
                                  ROUND=round_out, HAS_SINKS=sinks is not None,
                                  **pdl.launch_options(use_pdl))
    return out, rounded


class KernelNorm(NamedTuple):
    """What the attention kernels take of a layer's q/k norms (unused pointers: q)."""

    has_norm: bool
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool


def kernel_norm(attn, q: torch.Tensor) -> KernelNorm:
    """The layer's q/k norms as the kernels take them: Qwen3's, Gemma's (1 + w) or none."""
    if attn.q_norm is None:
        return KernelNorm(False, q, q, 0.0, False)
    return KernelNorm(True, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps,
                      is_unit_offset(attn.q_norm))


def reference_decode_attention(attn, q, k, v, cos, sin, k_cache, v_cache, position,
                               key_positions: torch.Tensor,
                               ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """The torch twin of fused_decode_attention (same arguments, same result); [1, Hq*D]."""
    q = q.view(1, attn.num_heads, attn.head_dim)
    k = k.view(1, attn.num_kv_heads, attn.head_dim)
    v = v.view(1, attn.num_kv_heads, attn.head_dim)
    q, k = attn_qk_norm_rope(attn, q, k, cos, sin, ops)
    k_cache.index_copy_(0, position, k.to(k_cache.dtype))
    v_cache.index_copy_(0, position, v.to(v_cache.dtype))
    group = attn.num_heads // attn.num_kv_heads
    # GQA without repeating K/V: query head h uses kv head h // group, so [Hq, D] -> [Hkv, G, D].
    q_grouped = q.view(attn.num_kv_heads, group, attn.head_dim)
    num_keys = key_positions.shape[0]
    keys = k_cache[:num_keys].to(q.dtype).permute(1, 2, 0)  # [Hkv, D, S]
    values = v_cache[:num_keys].to(q.dtype).permute(1, 0, 2)  # [Hkv, S, D]
    scores = torch.matmul(q_grouped, keys)  # [Hkv, G, S]
    window, sinks = attention_window(attn), attention_sinks(attn)
    if window or sinks is not None:  # a branch taken when the step is traced, not per step
        probs = ops.masked_softmax(scores, key_positions, position, attention_scale(attn),
                                   window, sinks)
    else:
        probs = ops.masked_softmax(scores, key_positions, position, attention_scale(attn))
    return torch.matmul(probs, values).reshape(1, attn.num_heads * attn.head_dim)


def check_fused(attn, kv_dtype: torch.dtype, device: torch.device, num_keys: int = 300) -> str:
    """'' when the fused kernels match the reference for this layer's shapes on device; else why.

    Runs once per decoder before any graph capture, so a kernel that fails to compile or
    disagrees on this GPU costs a logged fallback, not a wrong answer. Triton's CPU
    interpreter is one that disagrees in bf16: its tl.dot multiplies bf16 bit patterns
    (triton-lang/triton#11584), so bf16 models under the interpreter keep torch attention.
    """
    if not is_usable(device):
        return f"Triton cannot run on {device}"
    dtype = compute_dtype(attn)  # attention of QuantizedLinears has no parameters
    if kv_dtype != dtype:
        return f"KV cache dtype {kv_dtype} differs from the weights' {dtype}"
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q_dim, kv_dim = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = rand(1, q_dim), rand(1, kv_dim), rand(1, kv_dim)
    angles = torch.rand(1, attn.head_dim, generator=gen).to(device) * 6.0
    cos, sin = angles.cos(), angles.sin()
    position = torch.tensor([num_keys * 2 // 3], device=device)
    key_positions = torch.arange(num_keys, device=device)
    caches = [rand(num_keys, attn.num_kv_heads, attn.head_dim) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    try:
        with torch.inference_mode():
            got = fused_decode_attention(attn, q, k, v, cos, sin, *caches, position, key_positions)
            expected = reference_decode_attention(attn, q, k, v, cos, sin, *expected_caches,
                                                  position, key_positions)
            rounding = _rounding_error(attn, (q, k, v, cos, sin, *caches, position,
                                              key_positions), got)
    except Exception as exc:  # noqa: BLE001 - any compile or launch error means: do not use
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    if rounding:
        return rounding
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = (got.float() - expected.float()).abs().max().item()
    cache_error = max((a.float() - b.float()).abs().max().item()
                      for a, b in zip(caches, expected_caches))
    if not error <= tolerance or not cache_error <= tolerance * 4:
        return f"mismatch: output error {error:.3g}, cache error {cache_error:.3g}"
    return ""


def _rounding_error(attn, args: tuple, out: torch.Tensor) -> str:
    """'' when fused_decode_attention_rounded, called again with `args` (fused_decode_attention's,
    whose K/V write it repeats with the same values), gives that call's `out` and quantize_x's
    rounding of it, or the layer never rounds; else why."""
    if not rounds_output(attn, out.dtype):
        return ""
    got, rounded = fused_decode_attention_rounded(attn, *args)
    if not torch.equal(got, out):
        return "the rounding combine's output differs from the plain combine's"
    if not all(torch.equal(a, b) for a, b in zip(rounded, quantize_x(got))):
        return "the combine's int8 rounding differs from quantize_x's"
    return ""
