"""One token times blocks of a dp4a type (dp4a_dots.DP4A_TYPES) by
integer dot products: x in int8, four products an instruction.

The planes kernel (gemv_planes.py) turns every weight into a float and spends about ten
instructions a value (15 for Q6_K): more than the H200 issues in the time its bytes take to
arrive. Here, as llama.cpp's mmvq does for its quantized matrix-vector products:

1. `quantize_x`: x [M, K] in int8 per 32 values, with the scale d_x (max |x| / 127) and the
   sum s_x = d_x * sum(q) of each 32: one small launch, read by every row's program. In a
   decode step the kernel that makes x rounds it instead (`round_groups`, the same math;
   fast/decode_rounded.py), and the products take that as `rounded`.
2. The GEMV (`_dp4a_kernel`, dp4a_dots.py's decoding per type) reads each block's packed
   values as int32 words and multiplies four by four int8 x values in one `dp4a`, scales
   once per sub-block. Q6_K's 210-byte, Q8_0's 34-byte, Q4_0's 18-byte and Q5_0's 22-byte
   blocks put every other block at 2 mod 4 bytes, MXFP4's 17-byte blocks at any byte; their words are read
   aligned and realigned by a funnel shift.

sm_90 SASS of the K loop (bench/diag_quant_sass.py --dp4a): 1.9-2.3 instructions a value
for Q4_K, 3.3 for Q6_K (32-value units: more instructions than the 2.6 of its 128-value
groups, but neighbouring threads read neighbouring bytes), 1.6-1.9 for Q8_0, 2.7-2.9 for
Q5_0, against 9.9, 15.3 and 12.1 for the planes kernel;
IQ2_XXS (grid words looked up in L1) 4.9-5.2 against the planes kernel's 11-12.

As a PDL secondary (pdl.py), a product of a small weight (`prewait`: up to 16 MiB, a
decode's q/k/v and o) loads its first K step's weight words before the wait, while the
kernel before still runs; larger products wait first: the words held across the wait cost
registers a thread and so warps an SM, which bandwidth-bound products miss more than they
gain (docs/benchmarks.md, run 31).

The x rounding to int8 (about 0.4% of each 32's largest value) is the price: this path is
for the bf16/fp16 compute dtype only; float32 (the CPU interpreter's tests of the other
kernels, the verify mode) keeps the planes kernel.

Under TRITON_INTERPRET=1 (CPU tests) dp4a is emulated by shifts and multiplies: the same
integer sums, so the tests check the layout and the scales of the compiled kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.engine.core.kernels import launch, pdl
from strata.engine.core.quant.dp4a_dots import (
    DP4A_TYPE_NAMES,
    DP4A_TYPES,
    GROUP_VALUES,
    row_alignment,
)
from strata.engine.core.quant.lookup import lookup_table
from strata.units import MIB

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
    from strata.engine.core.quant.dp4a_dots import row_dots
except ImportError:  # Triton is optional: without it no tensor stays quantized
    triton = None

X_GROUP = 32  # x values per int8 scale: one Q4_K sub-block, one Q8_0 block
QUANTIZE_SUBS = 32  # x groups per program of quantize_x
# (BLOCK_ROWS, BLOCK_COLS, num_warps, STAGES) per type: rows per program, x values per K
# step. Each thread should hold whole groups (GROUP_VALUES; at least two for the 64-value
# types): a group split over threads costs shuffles and a layout conversion every step, and
# its scales are decoded twice (bench/diag_quant_sass.py --dp4a). A step's loads are all a
# thread has in flight (the loop is not unrolled), so wide steps keep more bytes in flight
# per SM; few rows and warps keep a 1024-row matrix on every SM; STAGES 3 has cp.async
# pipeline the next step.
_WIDE_CONFIGS = ((8, 2048, 4, 1), (4, 4096, 4, 1), (4, 2048, 2, 1), (2, 4096, 2, 1),
                 (1, 4096, 1, 1), (16, 2048, 8, 1), (8, 4096, 8, 1), (8, 2048, 4, 3))
# 64 values a thread: Q4_K, Q8_0, Q4_0 (Q4_1, Q5_0, Q5_1). (2, 2048, 2, 1) read the 8B's Q4_K
# gate_up and head at 0.68 and 0.84 of HBM where the tuner's pick read 0.63 and 0.77
# (docs/benchmarks.md, run 26).
_NARROW_CONFIGS = ((4, 2048, 4, 1), (4, 4096, 8, 1), (2, 2048, 2, 1))
# IQ2_XXS's groups are whole 256-value blocks: a tile of R rows and C columns has R * C / 256
# groups, at least one per thread (32 * num_warps); Qwen3-MoE's k [512, 2048] wants few rows.
_IQ2_CONFIGS = ((16, 2048, 4, 1), (8, 2048, 2, 1), (4, 2048, 1, 1), (8, 4096, 4, 1),
                (32, 2048, 8, 1), (8, 1024, 1, 1), (16, 1024, 2, 1), (2, 2048, 1, 1))
CONFIGS = {12: (*_WIDE_CONFIGS, *_NARROW_CONFIGS), 13: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),
           14: _WIDE_CONFIGS,
           8: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),
           2: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),  # Q4_0: Q8_0's 32-value groups, 18 bytes
           3: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),  # Q4_1, Q5_0, Q5_1: Q4_0's, 20-24 bytes
           6: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),
           7: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),
           39: (*_WIDE_CONFIGS, *_NARROW_CONFIGS),  # MXFP4: 32-value groups, 17 bytes
           16: _IQ2_CONFIGS}


def _candidates(configs) -> tuple:
    return tuple((n, k, w, {"STAGES": s}) for n, k, w, s in configs)


def interpreter_config(num_rows: int, num_cols: int, qtype: int) -> tuple:
    """The CPU interpreter's one tile: it pays per program and per op, not per value, so
    all rows (up to 256) in one program and the row's columns (up to 512) in one step."""
    rows = min(256, triton.next_power_of_2(num_rows))
    cols = max(GROUP_VALUES[int(qtype)], min(512, triton.next_power_of_2(num_cols)))
    return ((rows, cols, 4, 1),)


def prewait(use_pdl: bool, weight_bytes: int) -> bool:
    """Whether a PDL product loads its first K step's weights before its wait: for weights
    up to STRATA_DP4A_PREWAIT_MIB (default 16) MiB, whose products are short enough that
    the wait's latency shows; larger ones keep the wait first, since holding a step's words
    across it takes registers (sm_90: Q6_K's 8-row tile 72 -> 96 a thread) and costs warps
    on bandwidth-bound products (docs/benchmarks.md, run 31)."""
    return use_pdl and weight_bytes <= float(
        os.environ.get("STRATA_DP4A_PREWAIT_MIB", "16")) * MIB  # env read only for PDL


def is_enabled(x: torch.Tensor, qtype: int, raw: torch.Tensor | None = None) -> bool:
    """This path multiplies one token x by a weight of qtype (dp4a_dots.DP4A_TYPES), x in
    bf16/fp16 on CUDA (or the interpreter), blocks raw (if given) at a 4-aligned address,
    and not switched off by STRATA_DP4A=0 (for measuring)."""
    return (triton is not None and int(qtype) in DP4A_TYPES and x.shape[0] == 1
            and is_dtype_enabled(x) and (raw is None or raw.data_ptr() % 4 == 0))


def is_dtype_enabled(x: torch.Tensor) -> bool:
    """x may be rounded to int8 for dp4a: bf16/fp16, Triton usable, STRATA_DP4A not 0."""
    return (triton is not None and x.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("STRATA_DP4A") != "0" and launch.is_usable(x.device))


if triton is not None:

    @triton.jit
    def round_groups(v):
        """v [S, 32] float32 to (q int32 [S, 32] in -127..127, d [S], s [S]): v ~ d * q, d =
        max |v| / 127, s = d * sum(q). Shared by quantize_x and the kernels that round the x
        they make (fast/decode_rounded.py), so the same x gives the same bits."""
        amax = tl.max(tl.abs(v), axis=1)  # [S]
        scaled = v * tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)[:, None]
        q = (scaled + tl.where(scaled >= 0, 0.5, -0.5)).to(tl.int32)  # to nearest, ties away
        q = tl.minimum(tl.maximum(q, -127), 127)
        d = amax / 127.0
        return q, d, d * tl.sum(q, axis=1).to(tl.float32)

    @triton.jit
    def round_and_store(v, sub, num_subs, q_ptr, d_ptr, s_ptr):
        """round_groups(v) for x's groups sub [S] (v [S, 32] float32), stored where sub <
        num_subs: q at x's columns (int8), d and s at the group: what quantize_x writes."""
        q, d, s = round_groups(v)
        ok = sub < num_subs
        cols = sub[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(q_ptr + cols, q.to(tl.int8), mask=ok[:, None])
        tl.store(d_ptr + sub, d, mask=ok)
        tl.store(s_ptr + sub, s, mask=ok)

    @triton.jit
    def _quantize_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, stride_x, num_cols,
                           BLOCK_SUBS: tl.constexpr, USE_PDL: tl.constexpr):
        token = tl.program_id(1)
        pdl_wait(USE_PDL)  # x comes from the kernel just before
        num_subs = num_cols // 32
        sub = tl.program_id(0) * BLOCK_SUBS + tl.arange(0, BLOCK_SUBS)
        cols = sub[:, None] * 32 + tl.arange(0, 32)[None, :]  # [S, 32]
        ok = (sub < num_subs)[:, None]
        v = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        round_and_store(v, sub, num_subs, q_ptr + token * num_cols, d_ptr + token * num_subs,
                        s_ptr + token * num_subs)

    @triton.jit
    def _dp4a_kernel(
        xq_ptr, xd_ptr, xs_ptr, w_ptr, lut_ptr, b_ptr, out_ptr, N, ROW_BYTES,
        num_groups, QTYPE: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
        USE_PDL: tl.constexpr, PREWAIT: tl.constexpr, EMULATE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        """Rows of blocks of a dp4a type (DP4A_TYPES; dp4a_dots.row_dots)
        times one token. PREWAIT (with USE_PDL; prewait()): the first K step's weight loads come before
        the PDL wait (row_dots' WAIT), else the wait comes first."""
        EARLY: tl.constexpr = PREWAIT and STAGES == 1  # cp.async stages would hoist x's loads
        if not EARLY:
            pdl_wait(USE_PDL)
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        read = tl.minimum(rows, N - 1).to(tl.int64)  # rows past N reread the last: not stored
        row_off = (read * ROW_BYTES)[:, None, None]  # [R, 1, 1] bytes
        total = row_dots(w_ptr, row_off, xq_ptr, xd_ptr, xs_ptr, lut_ptr, num_groups,
                         QTYPE, GROUP, BLOCK_ROWS, BLOCK_COLS, STAGES, EMULATE, EARLY)
        if HAS_BIAS:
            total += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=rows < N)

    # One tuned launcher per type: their candidates differ.
    _tuned = {qtype: launch.tuned(_dp4a_kernel, _candidates(configs),
                                  key=("N", "num_groups", "QTYPE"))
              for qtype, configs in CONFIGS.items()}

    @triton.jit
    def _dp4a_pair_kernel(
        xq_ptr, xd_ptr, xs_ptr, w_ptr, lut_ptr, b_ptr, out_ptr, N_A, N_B,
        ROW_BYTES_A, ROW_BYTES_B, B_OFFSET, num_groups_a, num_groups_b,
        QTYPE_A: tl.constexpr, GROUP_A: tl.constexpr, QTYPE_B: tl.constexpr,
        GROUP_B: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
        PREWAIT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr, STAGES: tl.constexpr,
    ):
        """_dp4a_kernel over two runs of rows of two types lying back to back (part b from
        B_OFFSET bytes): the first programs take part a's rows, the rest part b's; output row
        N_A + r is part b's row r. PREWAIT as _dp4a_kernel's."""
        EARLY: tl.constexpr = PREWAIT and STAGES == 1
        if not EARLY:
            pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        programs_a = tl.cdiv(N_A, BLOCK_ROWS)
        local = tl.arange(0, BLOCK_ROWS)
        if pid < programs_a:
            rows = pid * BLOCK_ROWS + local
            row_off = (tl.minimum(rows, N_A - 1).to(tl.int64) * ROW_BYTES_A)[:, None, None]
            total = row_dots(w_ptr, row_off, xq_ptr, xd_ptr, xs_ptr, lut_ptr,
                             num_groups_a, QTYPE_A, GROUP_A, BLOCK_ROWS, BLOCK_COLS, STAGES,
                             EMULATE, EARLY)
            ok = rows < N_A
            out_rows = rows
        else:
            rows = (pid - programs_a) * BLOCK_ROWS + local
            row_off = (B_OFFSET + tl.minimum(rows, N_B - 1).to(tl.int64)
                       * ROW_BYTES_B)[:, None, None]
            total = row_dots(w_ptr, row_off, xq_ptr, xd_ptr, xs_ptr, lut_ptr,
                             num_groups_b, QTYPE_B, GROUP_B, BLOCK_ROWS, BLOCK_COLS, STAGES,
                             EMULATE, EARLY)
            ok = rows < N_B
            out_rows = N_A + rows
        if HAS_BIAS:
            total += tl.load(b_ptr + out_rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + out_rows, total.to(out_ptr.dtype.element_ty), mask=ok)

    # Candidates every type can take: IQ2_XXS's where a part is IQ2_XXS, else the wide ones.
    _pair_tuned = {iq2: launch.tuned(_dp4a_pair_kernel,
                                     _candidates(_IQ2_CONFIGS if iq2 else _WIDE_CONFIGS),
                                     key=("N_A", "N_B", "num_groups_a", "QTYPE_A", "QTYPE_B"))
                   for iq2 in (False, True)}


def _tuned_kernels() -> dict[str, object]:
    """Every autotuned dp4a launcher by a stable name."""
    return {**{f"_dp4a_kernel type {qtype}": tuned for qtype, tuned in _tuned.items()},
            **{f"_dp4a_pair_kernel iq2={iq2}": tuned for iq2, tuned in _pair_tuned.items()}}


def tuned_tiles() -> dict[str, dict[str, str]]:
    """The autotuner's pick for every (type, shape) the dp4a products have run in this
    process: {launcher: {repr(key): the tile}}. A kernel's tuning key changes with its source
    and with its line in the file, so a tree that edits gemv_dp4a.py tunes afresh, and two
    trees can run the same product on different tiles (docs/benchmarks.md, run 30);
    bench/quant_bench.py records these and can pin another run's (`pin_tiles`). Empty when
    interpreting."""
    if triton is None or launch.is_interpreting():
        return {}
    return {name: {repr(key): str(config) for key, config in tuned.cache.items()}
            for name, tuned in _tuned_kernels().items() if tuned.cache}


def pin_tiles(tiles: dict[str, dict[str, str]]) -> int:
    """Make the autotuner take tuned_tiles()'s picks from another run, without timing, for
    the keys they name (an A/B of two trees on the same tiles); returns how many. A tile
    that is not among this tree's candidates, or a launcher it lacks, is refused (ValueError)
    before any is pinned."""
    import ast

    if triton is None or launch.is_interpreting():
        raise ValueError("pin_tiles needs compiled Triton kernels: the interpreter tunes nothing")
    kernels, pins = _tuned_kernels(), []
    for name, picks in tiles.items():
        if name not in kernels:
            raise ValueError(f"no dp4a launcher {name!r} here (these: {sorted(kernels)})")
        by_text = {str(config): config for config in kernels[name].configs}
        for key, text in picks.items():
            if text not in by_text:
                raise ValueError(f"{name}'s tile {text!r} is not among this tree's candidates")
            pins.append((kernels[name], ast.literal_eval(key), by_text[text]))
    for tuned, key, config in pins:
        tuned.cache[key] = config
    return len(pins)


def quantize_x(x: torch.Tensor, use_pdl: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [M, K], d float32 [M, K/32], s float32 [M, K/32]) for x [M, K] (K % 32 == 0):
    x ~ d * q per 32 values, s = d * sum(q) of each 32. use_pdl: launched as a PDL secondary
    (pdl.py)."""
    num_tokens, num_cols = x.shape
    if num_cols % X_GROUP or x.stride(-1) != 1:
        raise ValueError(f"quantize_x takes rows of a multiple of {X_GROUP} contiguous values, "
                         f"got {tuple(x.shape)} strides {x.stride()}")
    q, d, s = empty_rounding(num_tokens, num_cols, x.device)
    _quantize_x_kernel[(triton.cdiv(num_cols // X_GROUP, QUANTIZE_SUBS), num_tokens)](
        x, q, d, s, x.stride(0), num_cols, BLOCK_SUBS=QUANTIZE_SUBS,
        **pdl.launch_options(use_pdl))
    return q, d, s


def empty_rounding(num_tokens: int, num_cols: int, device: torch.device) -> tuple:
    """Empty (q int8 [M, K], d, s float32 [M, K/32]): what quantize_x and the kernels that
    round the x they make (fast/decode_rounded.py, the attention's combine) write."""
    q = torch.empty(num_tokens, num_cols, dtype=torch.int8, device=device)
    d = torch.empty(num_tokens, num_cols // X_GROUP, dtype=torch.float32, device=device)
    return q, d, torch.empty_like(d)


def rounded_words(x: torch.Tensor, rounded: tuple | None, use_pdl: bool = False) -> tuple:
    """x's int8 rounding as the GEMVs read it: (q as int32 words, d, s). `rounded` is
    quantize_x(x) made by the kernel that made x (fast/decode_rounded.py); None: x is rounded
    here by a launch of its own."""
    if rounded is None:
        q, d, s = quantize_x(x, use_pdl)
    else:  # made elsewhere: it must be x's
        q, d, s = rounded
        if (q.shape != x.shape or q.dtype != torch.int8
                or d.shape != (x.shape[0], x.shape[1] // X_GROUP)):
            raise ValueError(f"x {tuple(x.shape)} comes with a rounding of int8 "
                             f"{tuple(q.shape)} {q.dtype} and scales {tuple(d.shape)}: not "
                             f"quantize_x's of it")
    return q.view(torch.int32), d, s


@dataclass(frozen=True)
class QuantizedPair:
    """Two runs of rows of two GGML types lying back to back in one buffer: Q4_K_M's q and
    k (Q4_K) then v (Q6_K), or an IQ2_XXS mix's q and k then a Q4_K v. `matmul_pair`
    multiplies both by one token in one launch, x rounded once, where separately each
    product is a launch and a rounding of its own."""

    raw: torch.Tensor  # uint8 [bytes of both parts], from part a's first byte
    qtypes: tuple[int, int]
    rows: tuple[int, int]
    row_bytes: tuple[int, int]
    num_cols: int

    @property
    def b_offset_bytes(self) -> int:
        return self.rows[0] * self.row_bytes[0]


def pair_supported(qtypes: tuple[int, int], row_bytes: tuple[int, int], num_cols: int,
                   base_address: int, rows_a: int) -> bool:
    """Whether matmul_pair takes such a pair: dp4a types both, a 4-aligned base, and part b
    starting where its type can be read (4-aligned for Q4_K and Q5_K, MXFP4 anywhere, else
    even)."""
    b_start = base_address + rows_a * row_bytes[0]
    needed_b = row_alignment(qtypes[1])
    return (triton is not None and all(int(t) in DP4A_TYPES for t in qtypes)
            and all(num_cols % GROUP_VALUES[int(t)] == 0 for t in qtypes)
            and base_address % 4 == 0 and b_start % needed_b == 0)


def is_pair_enabled(x: torch.Tensor) -> bool:
    """One bf16/fp16 token that dp4a may round (is_dtype_enabled)."""
    return x.shape[0] == 1 and is_dtype_enabled(x)


def matmul_pair(x: torch.Tensor, pair: QuantizedPair, bias: torch.Tensor | None = None,
                use_pdl: bool = False, rounded: tuple | None = None) -> torch.Tensor:
    """x [1, K] @ [A; B]^T (+ bias) for the pair's two parts: [1, rows a + rows b] in x's
    dtype, each row as `matmul` gives it for its own part. use_pdl: x's rounding and the
    product launch as PDL secondaries (pdl.py). rounded: quantize_x(x), made with x."""
    num_tokens, num_cols = x.shape
    if num_tokens != 1 or num_cols != pair.num_cols:
        raise ValueError(f"matmul_pair takes one token of {pair.num_cols} values, got "
                         f"{tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    (qtype_a, qtype_b), (rows_a, rows_b) = pair.qtypes, pair.rows
    xq, xd, xs = rounded_words(x, rounded, use_pdl)
    out = torch.empty(1, rows_a + rows_b, dtype=x.dtype, device=x.device)
    iq2 = 16 in pair.qtypes
    if launch.is_interpreting():
        rows, cols, warps, stages = interpreter_config(max(rows_a, rows_b), num_cols,
                                                       max(pair.qtypes, key=GROUP_VALUES.get))[0]
        candidates = _candidates(((rows, cols, warps, stages),))
    else:
        candidates = _candidates(_IQ2_CONFIGS if iq2 else _WIDE_CONFIGS)
    launch.launch(
        _pair_tuned[iq2],
        lambda block: (triton.cdiv(rows_a, block) + triton.cdiv(rows_b, block),),
        candidates,
        xq, xd, xs, pair.raw, lookup_table(x.device),
        bias if bias is not None else x, out, rows_a, rows_b, pair.row_bytes[0],
        pair.row_bytes[1], pair.b_offset_bytes, num_cols // GROUP_VALUES[qtype_a],
        num_cols // GROUP_VALUES[qtype_b], QTYPE_A=qtype_a, GROUP_A=GROUP_VALUES[qtype_a],
        QTYPE_B=qtype_b, GROUP_B=GROUP_VALUES[qtype_b], HAS_BIAS=bias is not None,
        PREWAIT=prewait(use_pdl, pair.raw.numel()), EMULATE=launch.is_interpreting(),
        use_pdl=use_pdl)
    return out


def matmul(x: torch.Tensor, raw: torch.Tensor, qtype: int, num_rows: int,
           bias: torch.Tensor | None = None, use_pdl: bool = False,
           rounded: tuple | None = None) -> torch.Tensor:
    """x [1, K] @ W^T (+ bias) for W [num_rows, K] in blocks of a dp4a type (DP4A_TYPES), raw
    [num_rows, row_bytes] (4-aligned); [1, num_rows] in x's dtype. use_pdl as matmul_pair's;
    rounded: quantize_x(x), made with x (fast/decode_rounded.py)."""
    num_tokens, num_cols = x.shape
    qtype = int(qtype)
    if qtype not in DP4A_TYPES or num_tokens != 1:
        raise ValueError(f"the dp4a kernel takes one token and {DP4A_TYPE_NAMES}, got "
                         f"{tuple(x.shape)} and type {qtype}")
    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]  # values a block
    if (raw.shape[0] != num_rows or num_cols % block or raw.data_ptr() % 4
            or raw.shape[1] % row_alignment(qtype)):
        raise ValueError(f"type {qtype} blocks of {num_rows} rows of {num_cols} columns must "
                         f"be uint8 [{num_rows}, row_bytes] at a 4-aligned address, got "
                         f"{tuple(raw.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(num_tokens, num_rows, dtype=x.dtype, device=x.device)
    args, kwargs = kernel_args(x, raw, qtype, num_rows, out, bias, use_pdl, rounded)
    launch.launch(
        _tuned[qtype], lambda rows: (triton.cdiv(num_rows, rows),),
        _candidates(interpreter_config(num_rows, num_cols, qtype) if launch.is_interpreting()
                    else CONFIGS[qtype]), *args, use_pdl=use_pdl, **kwargs)
    return out


def kernel_args(x: torch.Tensor, raw: torch.Tensor, qtype: int, num_rows: int,
                out: torch.Tensor, bias: torch.Tensor | None = None,
                use_pdl: bool = False, rounded: tuple | None = None) -> tuple[tuple, dict]:
    """`_dp4a_kernel`'s arguments but its tile and USE_PDL for x [1, K] (contiguous) times
    raw's blocks into out: x rounded to int8 here (a PDL secondary with use_pdl) unless
    `rounded` came with it (rounded_words). matmul launches them tuned;
    bench/diag_dp4a_sweep.py at each tile of its grid."""
    xq, xd, xs = rounded_words(x, rounded, use_pdl)
    args = (xq, xd, xs, raw, lookup_table(x.device),
            bias if bias is not None else x, out)
    kwargs = {"N": num_rows, "ROW_BYTES": raw.shape[1],
              "num_groups": x.shape[1] // GROUP_VALUES[qtype], "QTYPE": qtype,
              "GROUP": GROUP_VALUES[qtype], "HAS_BIAS": bias is not None,
              "PREWAIT": prewait(use_pdl, raw.numel()), "EMULATE": launch.is_interpreting()}
    return args, kwargs
