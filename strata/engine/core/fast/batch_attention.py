"""Decode attention of B sequences in one launch pair, each over its own slot's KV pages.

A batch's rows belong to different slots, and every slot has its own address range in the kv
arena (its own pages, its own length). The kernels find row b's cache by address: the caches
of one layer are passed as one base tensor and an element offset per row (`KVRows`), so a
CUDA graph captured once replays for any mix of slots; only the offsets, positions and tokens
(static device buffers) change between steps.

Otherwise the kernels are decode_attention.py's, with the row as a third grid axis: every
program norms and rotates its query group and the row's new key, writes that K/V at the row's
position (split 0), scans its split of keys with an online softmax; the combine merges the
splits. A row with position -1 is padding (a batch padded up to its bucket): it writes and
reads nothing, and its output is zeros.

`reference_batch_attention` is the torch twin (the CPU path), taking the caches themselves.
"""

from __future__ import annotations

import torch

from strata.engine.core.fast.decode_attention import (
    is_usable,
    kernel_norm,
    reference_decode_attention,
    split_plan,
)
from strata.engine.core.fast.pointwise import (
    EAGER_OPS,
    PointwiseOps,
    attention_scale,
    attention_sinks,
    attention_window,
)

try:
    import triton
    import triton.language as tl

    from strata.engine.core.fast.decode_attention import _norm_rope, merge_splits
except ImportError:  # optional: the reference path needs only torch
    triton = None

BLOCK_KEYS = 64  # keys per inner step; >= 16 for tl.dot on the GPU
PAD_POSITION = -1  # a padding row's position: it writes and reads nothing

__all__ = ["PAD_POSITION", "batch_attention", "check_batch_attention", "is_usable",
           "reference_batch_attention"]


if triton is not None:
    _EMPTY_MAX = tl.constexpr(-1.0e30)

    @triton.jit
    def _batch_split_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, k_base, v_base, k_off_ptr,
        v_off_ptr, pos_ptr, max_ptr, sum_ptr, acc_ptr, eps, scale, stride_token, q_row, kv_row,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, HAS_NORM: tl.constexpr, NUM_KEYS: tl.constexpr,
        SPLIT_KEYS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        UNIT_OFFSET: tl.constexpr, WINDOW: tl.constexpr,
    ):
        head = tl.program_id(0)
        split = tl.program_id(1)
        row = tl.program_id(2)
        pos = tl.load(pos_ptr + row)
        k_cache = k_base + tl.load(k_off_ptr + row)  # this row's slot, layer's K [S, Hkv, D]
        v_cache = v_base + tl.load(v_off_ptr + row)
        cols = tl.arange(0, HEAD_DIM)
        partner = (cols + HEAD_DIM // 2) % HEAD_DIM
        cos = tl.load(cos_ptr + row * HEAD_DIM + cols).to(tl.float32)
        sin = tl.load(sin_ptr + row * HEAD_DIM + cols).to(tl.float32)
        one = tl.arange(0, 1)
        k_off = (head + one)[:, None] * HEAD_DIM
        k_row = k_ptr + row * kv_row
        k_new = _norm_rope(tl.load(k_row + k_off + cols[None, :]).to(tl.float32),
                           tl.load(k_row + k_off + partner[None, :]).to(tl.float32),
                           kn_ptr, cols, partner, cos, sin, HAS_NORM, eps, HEAD_DIM,
                           UNIT_OFFSET)
        k_new = k_new.to(k_base.dtype.element_ty)
        v_new = tl.load(v_ptr + row * kv_row + k_off + cols[None, :]).to(v_base.dtype.element_ty)
        if split == 0 and pos >= 0:  # padding rows own no cache
            slot = pos.to(tl.int64) * stride_token + k_off + cols[None, :]
            tl.store(k_cache + slot, k_new)
            tl.store(v_cache + slot, v_new)
        g = tl.arange(0, GROUP_PAD)
        g_ok = g < GROUP
        q_off = (head * GROUP + g)[:, None] * HEAD_DIM
        q_row_ptr = q_ptr + row * q_row
        q_rows = tl.load(q_row_ptr + q_off + cols[None, :], mask=g_ok[:, None], other=0.0)
        q_partners = tl.load(q_row_ptr + q_off + partner[None, :], mask=g_ok[:, None],
                             other=0.0)
        q = _norm_rope(q_rows.to(tl.float32), q_partners.to(tl.float32),
                       qn_ptr, cols, partner, cos, sin, HAS_NORM, eps, HEAD_DIM, UNIT_OFFSET)
        q = (q * scale).to(k_base.dtype.element_ty)
        m_i = tl.full([GROUP_PAD], _EMPTY_MAX, tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for offset in range(0, SPLIT_KEYS, BLOCK_S):
            keys = split * SPLIT_KEYS + offset + tl.arange(0, BLOCK_S)
            valid = (keys <= pos) & (keys < NUM_KEYS)
            if WINDOW > 0:  # the window's slots only: the others are never read
                valid = valid & (keys > pos - WINDOW)
            kv_off = keys[:, None].to(tl.int64) * stride_token + head * HEAD_DIM + cols[None, :]
            fresh = keys[:, None] == pos  # the slot this step writes: use the registers
            kb = tl.load(k_cache + kv_off, mask=valid[:, None] & ~fresh, other=0.0)
            kb = tl.where(fresh, k_new, kb)
            vb = tl.load(v_cache + kv_off, mask=valid[:, None] & ~fresh, other=0.0)
            vb = tl.where(fresh, v_new, vb)
            s = tl.dot(q, tl.trans(kb))  # [GROUP_PAD, BLOCK_S] float32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
        out_row = ((row * NUM_HEADS) + head * GROUP + g) * NUM_SPLITS + split
        tl.store(max_ptr + out_row, m_i, mask=g_ok)
        tl.store(sum_ptr + out_row, l_i, mask=g_ok)
        tl.store(acc_ptr + out_row[:, None] * HEAD_DIM + cols[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _batch_combine_kernel(max_ptr, sum_ptr, acc_ptr, out_ptr, sink_ptr,
                              NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                              HAS_SINKS: tl.constexpr):
        head = tl.program_id(0)
        row = tl.program_id(1)
        splits = tl.arange(0, BLOCK_SPLITS)
        ok = splits < NUM_SPLITS
        cols = tl.arange(0, HEAD_DIM)
        rows = (row * NUM_HEADS + head) * NUM_SPLITS + splits
        m = tl.load(max_ptr + rows, mask=ok, other=_EMPTY_MAX)
        w, total = merge_splits(m, tl.load(sum_ptr + rows, mask=ok, other=0.0), sink_ptr, head,
                                HAS_SINKS)
        acc = tl.load(acc_ptr + rows[:, None] * HEAD_DIM + cols[None, :], mask=ok[:, None],
                      other=0.0)
        # A padding row saw no key (total 0, or a sink's alone): zeros, never 0/0.
        out = tl.sum(w[:, None] * acc, axis=0) / tl.maximum(total, 1e-30)
        out = tl.where(total > 0, out, 0.0)
        tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + cols,
                 out.to(out_ptr.dtype.element_ty))


def batch_attention(attn, q, k, v, cos, sin, k_base, v_base, k_offsets, v_offsets, positions,
                    num_keys: int) -> torch.Tensor:
    """Attention of one token per row over its own cache slots 0..num_keys-1; [B, Hq*D].

    q [B, Hq*D], k/v [B, Hkv*D] as projected (rows may be strided, columns contiguous);
    cos/sin [B, D] float32; row b's caches start k_offsets[b] / v_offsets[b] elements (int64
    [B]) past k_base / v_base, each [S, Hkv, D] contiguous like the bases; positions [B]
    (PAD_POSITION: a padding row). Writes row b's K/V at positions[b] of its own cache.
    """
    batch = q.shape[0]
    head_dim, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    if head_dim & (head_dim - 1) or k_base.dtype != q.dtype or not k_base.is_contiguous():
        raise ValueError(f"batched decode attention needs a power-of-two head_dim and contiguous "
                         f"caches in the activation dtype, got D={head_dim}, {k_base.dtype}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k and v need contiguous columns")
    if k.stride(0) != v.stride(0):
        raise ValueError("k and v need the same row stride")
    per_split, num_splits = split_plan(num_keys)
    num_heads = attn.num_heads
    stats = torch.empty(2, batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                      device=q.device)
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    norm = kernel_norm(attn, q)
    sinks = attention_sinks(attn)
    _batch_split_kernel[(attn.num_kv_heads, num_splits, batch)](
        q, k, v, cos.contiguous(), sin.contiguous(), norm.q_weight, norm.k_weight, k_base,
        v_base, k_offsets, v_offsets, positions, stats[0], stats[1], acc, norm.eps,
        attention_scale(attn), k_base.stride(0), q.stride(0), k.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HAS_NORM=norm.has_norm,
        NUM_KEYS=num_keys, SPLIT_KEYS=per_split, NUM_SPLITS=num_splits, BLOCK_S=BLOCK_KEYS,
        UNIT_OFFSET=norm.unit_offset, WINDOW=attention_window(attn),
    )
    _batch_combine_kernel[(num_heads, batch)](
        stats[0], stats[1], acc, out, sinks if sinks is not None else out,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_SPLITS=triton.next_power_of_2(num_splits), HAS_SINKS=sinks is not None)
    return out


def reference_batch_attention(attn, q, k, v, cos, sin, k_caches, v_caches, positions,
                              num_keys: int, ops: PointwiseOps = EAGER_OPS) -> torch.Tensor:
    """The torch twin of batch_attention, given each row's caches (None for padding rows)
    and positions as a list of ints; [B, Hq*D]. A host loop: for the CPU and for tests."""
    out = torch.zeros(q.shape[0], attn.num_heads * attn.head_dim, dtype=q.dtype,
                      device=q.device)
    key_positions = torch.arange(num_keys, device=q.device)
    for b, position in enumerate(positions):
        if position == PAD_POSITION or k_caches[b] is None:
            continue
        where = torch.tensor([position], device=q.device)
        out[b] = reference_decode_attention(
            attn, q[b : b + 1].contiguous(), k[b : b + 1].contiguous(),
            v[b : b + 1].contiguous(), cos[b : b + 1], sin[b : b + 1], k_caches[b],
            v_caches[b], where, key_positions, ops)[0]
    return out


def check_batch_attention(attn, kv_dtype: torch.dtype, device: torch.device,
                          num_keys: int = 300) -> str:
    """'' when the batched kernels match the torch twin for this layer's shapes on device
    (three rows in caches of their own, the third one padding); else why. Runs once, before
    any batch graph is captured, so a kernel that fails here costs eager batches, not a
    wrong answer."""
    from strata.engine.core.quant.weight import compute_dtype

    if not is_usable(device):
        return f"Triton cannot run on {device}"
    dtype = compute_dtype(attn)
    if kv_dtype != dtype:
        return f"KV cache dtype {kv_dtype} differs from the weights' {dtype}"
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q_dim, kv_dim = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    rows = 3
    qkv = rand(rows, q_dim + 2 * kv_dim)  # row-strided views, as the fused projection gives
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    angles = torch.rand(rows, attn.head_dim, generator=gen).to(device) * 6.0
    cos, sin = angles.cos(), angles.sin()  # [B, D] float32, as the model's rope gives
    # One buffer holds both rows' caches: row 1's start num_keys positions after row 0's.
    shape = (2 * num_keys, attn.num_kv_heads, attn.head_dim)
    k_all, v_all = rand(*shape), rand(*shape)
    positions = [num_keys * 2 // 3, num_keys // 5, PAD_POSITION]
    step = num_keys * attn.num_kv_heads * attn.head_dim
    offsets = torch.tensor([0, step, 0], device=device)
    expected_k, expected_v = k_all.clone(), v_all.clone()
    try:
        with torch.inference_mode():
            got = batch_attention(attn, q, k, v, cos, sin, k_all[:num_keys], v_all[:num_keys],
                                  offsets, offsets, torch.tensor(positions, device=device),
                                  num_keys)
            caches = [expected_k[:num_keys], expected_k[num_keys:], None]
            values = [expected_v[:num_keys], expected_v[num_keys:], None]
            expected = reference_batch_attention(attn, q, k, v, cos, sin, caches, values,
                                                 positions, num_keys)
    except Exception as exc:  # noqa: BLE001 - any compile or launch error means: do not use
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    # Relative to the values' scale: the kernels rotate in float32, the twin in bf16.
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = (got.float() - expected.float()).abs().max().item() / max(
        1.0, expected.float().abs().max().item())
    cache_error = max((k_all.float() - expected_k.float()).abs().max().item(),
                      (v_all.float() - expected_v.float()).abs().max().item()) / max(
        1.0, expected_k.float().abs().max().item())
    if not error <= tolerance or not cache_error <= tolerance * 4:
        return f"mismatch: output error {error:.3g}, cache error {cache_error:.3g}"
    return ""
