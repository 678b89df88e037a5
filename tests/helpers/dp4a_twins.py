"""dp4a_dots' inline-PTX helpers (funnel: shf.r.wrap, byte_perm: prmt) run over arrays of
words, and numpy's reading of the PTX manual for both: the CPU test checks the emulated
twins against numpy, the GPU test the instructions themselves. Import it after choosing
the interpreter (triton.jit reads TRITON_INTERPRET when it decorates)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from strata.engine.core.quant.dp4a_dots import byte_perm, funnel


def funnel_reference(lo: np.ndarray, hi: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The low 32 bits of hi:lo >> shift (uint32 arrays)."""
    wide = (hi.astype(np.uint64) << np.uint64(32)) | lo.astype(np.uint64)
    return ((wide >> shift.astype(np.uint64)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def byte_perm_reference(a: np.ndarray, b: np.ndarray, selector: np.ndarray) -> np.ndarray:
    """prmt.b32's default mode: byte i is byte (nibble i & 7) of b:a, or with nibble i's
    bit 3 that byte's sign bit copied into all eight bits."""
    source = np.stack([(w >> np.uint32(8 * i)) & np.uint32(255) for w in (a, b)
                       for i in range(4)])  # [8, N]
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (selector >> np.uint32(4 * i)) & np.uint32(15)
        byte = np.take_along_axis(source, (nibble & np.uint32(7)).astype(np.int64)[None], 0)[0]
        byte = np.where(nibble & np.uint32(8), np.where(byte & np.uint32(128), 255, 0), byte)
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def random_words(count: int, seed: int) -> dict[str, np.ndarray]:
    """uint32 words lo, hi, a, b, a selector of random nibbles (sign bits both ways) and
    shifts 0, 8, 16, 24 in turn."""
    rng = np.random.default_rng(seed)
    words = {name: rng.integers(0, 2**32, size=count, dtype=np.uint64).astype(np.uint32)
             for name in ("lo", "hi", "a", "b", "selector")}
    words["shift"] = (np.arange(count, dtype=np.uint32) % 4) * 8
    return words


@triton.jit
def _twins_kernel(lo_ptr, hi_ptr, shift_ptr, a_ptr, b_ptr, sel_ptr, funnel_ptr, perm_ptr, n,
                  EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < n
    lo, hi = tl.load(lo_ptr + at, mask=ok), tl.load(hi_ptr + at, mask=ok)
    shift = tl.load(shift_ptr + at, mask=ok)
    tl.store(funnel_ptr + at, funnel(lo, hi, shift, EMULATE), mask=ok)
    a, b = tl.load(a_ptr + at, mask=ok), tl.load(b_ptr + at, mask=ok)
    tl.store(perm_ptr + at, byte_perm(a, b, tl.load(sel_ptr + at, mask=ok), EMULATE), mask=ok)


def run_twins(words: dict[str, np.ndarray], device: str, emulate: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    """(funnel(lo, hi, shift), byte_perm(a, b, selector)) by the Triton helpers as uint32."""
    tensors = {k: torch.from_numpy(v.view(np.int32)).to(device) for k, v in words.items()}
    count = words["lo"].shape[0]
    outs = [torch.empty(count, dtype=torch.int32, device=device) for _ in range(2)]
    _twins_kernel[(triton.cdiv(count, 256),)](
        tensors["lo"], tensors["hi"], tensors["shift"], tensors["a"], tensors["b"],
        tensors["selector"], *outs, count, EMULATE=emulate, BLOCK=256)
    return tuple(out.cpu().numpy().view(np.uint32) for out in outs)  # type: ignore[return-value]


def check_twins(device: str, emulate: bool, count: int, seed: int) -> None:
    """funnel and byte_perm over `count` random words on `device` (the emulated twins or the
    instructions) equal numpy's reading of the PTX manual."""
    words = random_words(count, seed)
    shifted, permuted = run_twins(words, device, emulate=emulate)
    np.testing.assert_array_equal(shifted, funnel_reference(words["lo"], words["hi"],
                                                            words["shift"]))
    np.testing.assert_array_equal(permuted, byte_perm_reference(words["a"], words["b"],
                                                                words["selector"]))
