"""Causal prefill attention with GPT-OSS's per-head sinks, in one Triton kernel.

Why it exists: torch SDPA, flash and cuDNN take no sink logits, so GPT-OSS's prefill attended
in torch (models/gpt_oss.sink_attention): float32 matmuls by query blocks without tensor cores,
a cat of the sink column, a softmax and K/V repeated to the query heads - about 100 ms of a
4096-token prefill's 404 ms on an H100 (docs/benchmarks.md, "Run 35"). Here, flash-attention
style, a program holds BLOCK_M queries of one head and streams its kv head's keys in BLOCK_N
blocks: bf16 tl.dot with float32 accumulation and an online softmax (in base 2) whose running
max starts at the head's sink and whose running sum starts at 1 (that sink's exp(sink - max)),
so the sink joins every denominator with no extra column, and a row that a block masks
entirely never computes -inf - -inf.

- Queries are the last T of S positions (chunked prefill): query i sits at S - T + i.
- window > 0: the query at p sees keys p - window + 1 .. p; blocks wholly outside are skipped.
- GQA: query head h reads kv head h // group in place (strides): K/V are never repeated.
- Key blocks that every query of the block sees run without a mask; only the causal diagonal
  and the window's lower edge are masked.

Block sizes: BLOCK_M 64, BLOCK_N 64, 4 warps, 2 stages (16 rows for the one-query chunk),
the best or within 2% of the best of six tilings at gpt-oss-20b's shape on an H100, full and
windowed, 2048 and 4096 queries (`bench/diag_sink_attention.py --sweep`, run 36). The torch sink_attention
stays the reference and the path where Triton cannot run (`is_usable`). Triton's CPU
interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584), so under it the
tiles go to float32 before each dot (DOT_FP32); compiled for a GPU the dots take bf16.
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the torch reference needs only torch
    triton = None

LOG2_E = 1.4426950408889634  # log2(e): the kernel's softmax runs in base 2

if triton is not None:
    _LOG2_E = tl.constexpr(LOG2_E)

    @triton.jit
    def _key_block(acc, m_i, l_i, q, k_base, v_base, start, q_pos, cols, col_ok, num_keys,
                   stride_ks, stride_vs, qk_scale, WINDOW: tl.constexpr, MASKED: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
        """One block of keys start..start+BLOCK_N-1 folded into (acc, max, sum); MASKED: some
        query of the block must not see some key of it (the diagonal, the window's edge, S)."""
        keys = start + tl.arange(0, BLOCK_N)
        load_ok = col_ok[None, :]
        if MASKED:
            load_ok = load_ok & (keys < num_keys)[:, None]
        rows = keys[:, None].to(tl.int64)
        k = tl.load(k_base + rows * stride_ks + cols[None, :], mask=load_ok, other=0.0)
        v = tl.load(v_base + rows * stride_vs + cols[None, :], mask=load_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], base 2
        if MASKED:
            seen = (keys[None, :] <= q_pos[:, None]) & (keys < num_keys)[None, :]
            if WINDOW > 0:
                seen = seen & (keys[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: m_i started at the sink
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    # The lengths vary per prompt: specialising on them (== 1, % 16) would compile variants.
    @triton.jit(do_not_specialize=["num_tokens", "num_keys"])
    def _sink_attention_kernel(
        q_ptr, k_ptr, v_ptr, sink_ptr, out_ptr, num_tokens, num_keys, qk_scale,
        stride_qh, stride_qt, stride_kh, stride_ks, stride_vh, stride_vs, stride_oh, stride_ot,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # The last query blocks see the most keys: they start first.
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_tokens
        first = num_keys - num_tokens + block * BLOCK_M  # the block's first query position
        q_pos = first + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < HEAD_DIM
        q_off = head * stride_qh + rows[:, None].to(tl.int64) * stride_qt + cols[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        sink = tl.load(sink_ptr + head).to(tl.float32) * _LOG2_E
        m_i = tl.zeros([BLOCK_M], tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)  # exp2(sink - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        end = tl.minimum(num_keys, first + BLOCK_M)
        # Key blocks [full_lo, full_hi) are seen whole by every row: before the first row's
        # position and, with a window, after the last row's window start.
        full_hi = (first + 1) // BLOCK_N * BLOCK_N
        if WINDOW > 0:
            lo = tl.maximum(first - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            edge = tl.maximum(first + BLOCK_M - WINDOW, 0)
            full_lo = tl.minimum((edge + BLOCK_N - 1) // BLOCK_N * BLOCK_N, full_hi)
            for start in range(lo, full_lo, BLOCK_N):
                acc, m_i, l_i = _key_block(acc, m_i, l_i, q, k_base, v_base, start, q_pos,
                                           cols, col_ok, num_keys, stride_ks, stride_vs,
                                           qk_scale, WINDOW, True, BLOCK_N, DOT_FP32, PRECISION)
        else:
            full_lo = 0
        for start in range(full_lo, full_hi, BLOCK_N):
            acc, m_i, l_i = _key_block(acc, m_i, l_i, q, k_base, v_base, start, q_pos, cols,
                                       col_ok, num_keys, stride_ks, stride_vs, qk_scale,
                                       WINDOW, False, BLOCK_N, DOT_FP32, PRECISION)
        for start in range(full_hi, end, BLOCK_N):
            acc, m_i, l_i = _key_block(acc, m_i, l_i, q, k_base, v_base, start, q_pos, cols,
                                       col_ok, num_keys, stride_ks, stride_vs, qk_scale,
                                       WINDOW, True, BLOCK_N, DOT_FP32, PRECISION)
        out = acc / l_i[:, None]
        o_off = head * stride_oh + rows[:, None].to(tl.int64) * stride_ot + cols[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def is_usable(device: torch.device) -> bool:
    """Triton importable and able to run on device (CUDA, or the CPU interpreter in tests)."""
    return triton is not None and launch.is_usable(device)


def block_plan(num_tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a chunk of num_tokens queries (run 36's
    sweep; tl.dot needs blocks of 16 or more)."""
    return (16 if num_tokens <= 16 else 64), 64, 4, 2  # 16: the last layer's one query


def fused_sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         sinks: torch.Tensor, window: int, scale: float | None = None, *,
                         blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """gpt_oss.sink_attention in one kernel: causal attention of q [Hq, T, D] (the last T of S
    positions) over keys/values [Hkv, S, D] (any strides with unit last one), each head's
    softmax denominator also holding exp(sinks[h]); with window > 0 the query at p sees keys
    p - window + 1 .. p. scale: the scores' factor (None: 1/sqrt(D)). Returns [Hq, T, D], a
    view of a contiguous [T, Hq, D] (what o_proj reads). blocks: (BLOCK_M, BLOCK_N) instead of
    block_plan's, for tests that want many blocks from small tensors."""
    num_heads, num_tokens, head_dim = q.shape
    num_kv_heads, num_keys, _ = keys.shape
    if (num_heads % num_kv_heads or num_keys < num_tokens or values.shape != keys.shape
            or sinks.shape != (num_heads,) or q.dtype != keys.dtype or q.dtype != values.dtype):
        raise ValueError(
            f"sink attention got q {tuple(q.shape)} {q.dtype}, keys {tuple(keys.shape)} "
            f"{keys.dtype}, values {tuple(values.shape)} {values.dtype}, sinks "
            f"{tuple(sinks.shape)}: query heads must be a multiple of kv heads, keys must "
            "include the queries, one sink per query head, one dtype")
    q, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys, values))
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype,
                      device=q.device).transpose(0, 1)
    block_m, block_n, num_warps, num_stages = block_plan(num_tokens)
    if blocks is not None:
        block_m, block_n = blocks
    scale = head_dim**-0.5 if scale is None else scale
    _sink_attention_kernel[(triton.cdiv(num_tokens, block_m), num_heads)](
        q, keys, values, sinks, out, num_tokens, num_keys, scale * LOG2_E,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        GROUP=num_heads // num_kv_heads, WINDOW=max(0, int(window)), BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_FP32=launch.is_interpreting(),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return out

