"""Prefill attention on fused kernels: GQA and a causal mask, never a [heads, T, S] score tensor.

SDPA picks its flash / memory-efficient kernels only for 4-D inputs [N, heads, L, D]; the 3-D
tensors of an unbatched model silently take the math kernel, which materialises float scores
per head (20 GiB for a 32k prompt in 2k chunks). So everything here is 4-D with N = 1.

- A chunk at position 0 (T == S) is plain `is_causal=True`. A full-size one goes to cuDNN's
  kernel where it runs: it beat flash there (`bench/diag_attention.py`; figures:
  docs/benchmarks.md, "Figures behind the fast path"). But cuDNN builds a plan for every new
  length, far longer than a chunk's attention, and chat prompts come in every length; so only
  the prefill's fixed chunk length takes it (`prefer_cudnn`), and the load warms that one plan
  up. For a chunk after cached tokens cuDNN was slower: flash.
- A chunk after cached tokens needs the causal diagonal aligned bottom-right: query i sits at
  S - T + i. SDPA's `causal_lower_right` bias sends that straight to the flash kernel, whose
  causal flag means lower-right (torch.nn.attention.bias, CausalBias._dispatch).
- GQA: flash reads the Hkv key heads for Hq query heads itself. Where flash cannot run (fp32,
  odd head sizes, an old GPU), K/V are repeated to Hq heads for this chunk only and the
  memory-efficient kernel runs instead.

On CUDA the math kernel is never a silent fallback: `flash_attention` raises if neither fused
kernel can take the inputs. On the CPU (tests, the reference) SDPA's own kernels run.

A sliding window (Gemma 3's local layers) keeps only the keys the chunk can see; one query
needs no mask then, a chunk a band mask [T, S'] that only the memory-efficient kernel takes
(flash has no mask input), with K/V repeated to the query heads for that chunk.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

FUSED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
# Learned on first use: whether this torch build's flash op takes Hkv < Hq heads directly.
_flash_takes_gqa: bool | None = None
# Learned on first use: whether cuDNN attention runs here (build, GPU and inputs permitting).
_cudnn_works: bool | None = None


def _mask_args(num_tokens: int, num_keys: int) -> tuple[object, bool]:
    """(attn_mask, is_causal) for T queries at the end of S keys."""
    if num_tokens == 1:
        return None, False  # one query sees every key
    if num_tokens == num_keys:
        return None, True
    # Imported here: torch.nn.attention.bias imports torch._dynamo (seconds), which a load
    # must not wait for while a standby still imports it (issue 18: load from standby).
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(num_tokens, num_keys), False


def repeat_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[N, Hkv, S, D] -> [N, Hkv * group, S, D]; query head h reads kv head h // group."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _can_use(kernel: str, q, k, v, is_causal: bool, is_gqa: bool) -> bool:
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, None, 0.0, is_causal, is_gqa)
    check = {"flash": cuda.can_use_flash_attention, "efficient": cuda.can_use_efficient_attention,
             "cudnn": getattr(cuda, "can_use_cudnn_attention", None)}[kernel]
    return check is not None and bool(check(params, False))


def _cudnn_causal(q4, k4, v4, is_gqa: bool, scale: float | None = None) -> torch.Tensor | None:
    """Causal attention by cuDNN, or None where it cannot run (learned once, then skipped)."""
    global _cudnn_works
    if _cudnn_works is False or not _can_use("cudnn", q4, k4, v4, True, is_gqa):
        return None
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                 enable_gqa=is_gqa)
    except RuntimeError as exc:
        if _cudnn_works:  # it ran before: this is a real error, not a capability
            raise
        _cudnn_works = False
        log.warning("cuDNN attention refused a prefill chunk (%s); using flash attention", exc)
        return None
    _cudnn_works = True
    return out


def _band_mask(num_tokens: int, num_keys: int, window: int, device) -> torch.Tensor:
    """[T, S] True where query i (at S - T + i) sees key j: j <= S - T + i < j + window."""
    query_pos = torch.arange(num_keys - num_tokens, num_keys, device=device)[:, None]
    key_pos = torch.arange(num_keys, device=device)[None, :]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _windowed(q4, k4, v4, window: int, group: int, scale: float | None) -> torch.Tensor:
    """Causal attention of q4 [1, Hq, T, D] over the last S keys, each query seeing only the
    newest `window` of them (itself included)."""
    num_tokens, num_keys = q4.shape[2], k4.shape[2]
    if num_keys > window + num_tokens - 1:  # keys no query of the chunk sees
        k4, v4 = k4[:, :, -(window + num_tokens - 1):], v4[:, :, -(window + num_tokens - 1):]
        num_keys = k4.shape[2]
    if num_tokens == 1:
        mask, is_causal = None, False  # the one query sees every key left
    elif num_keys <= window:
        mask, is_causal = _mask_args(num_tokens, num_keys)  # the window cuts nothing
    else:
        mask, is_causal = _band_mask(num_tokens, num_keys, window, q4.device), False
    if q4.device.type != "cuda":
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=group > 1)
    k4, v4 = repeat_kv_heads(k4, group), repeat_kv_heads(v4, group)
    with sdpa_kernel(FUSED_BACKENDS):
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal,
                                              scale=scale)


def flash_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefer_cudnn: bool = False,
    scale: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last T of S positions: q [Hq, T, D], keys/values [Hkv, S, D].

    Returns [Hq, T, D]. Query i attends to keys 0..S-T+i (with `window`, only the newest
    `window` of those). Hq must be a multiple of Hkv. scale: the scores' factor (None:
    1/sqrt(D)). prefer_cudnn: try cuDNN first when T == S (for a length that recurs: see above).
    """
    global _flash_takes_gqa
    num_heads, num_tokens, _ = q.shape
    num_kv_heads, num_keys, _ = keys.shape
    if num_heads % num_kv_heads or num_keys < num_tokens:
        raise ValueError(
            f"attention got {num_heads} query heads over {num_kv_heads} kv heads and {num_tokens} "
            f"queries over {num_keys} keys: query heads must be a multiple of kv heads and "
            "keys must include the queries"
        )
    group = num_heads // num_kv_heads
    if window is not None:
        return _windowed(q[None], keys[None], values[None], window, group, scale)[0]
    mask, is_causal = _mask_args(num_tokens, num_keys)
    q4, k4, v4 = q[None], keys[None], values[None]  # [1, heads, L, D]
    if q.device.type != "cuda":
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
        )
        return out[0]
    if prefer_cudnn and is_causal and num_tokens > 1:
        out = _cudnn_causal(q4, k4, v4, group > 1, scale)
        if out is not None:
            return out[0]
    # The kernel checks ignore the mask; CausalBias hands flash its lower-right causal flag.
    flag = is_causal or mask is not None
    if _flash_takes_gqa is not False and _can_use("flash", q4, k4, v4, flag, group > 1):
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = F.scaled_dot_product_attention(
                    q4, k4, v4, attn_mask=mask, is_causal=is_causal, scale=scale,
                    enable_gqa=group > 1
                )
            if group > 1:
                _flash_takes_gqa = True
            return out[0]
        except RuntimeError as exc:
            if group == 1:
                raise
            _flash_takes_gqa = False
            log.warning("flash attention refused GQA (%s); repeating K/V heads per chunk", exc)
    # Repeat K/V for this chunk only (Hq x S x D, not Hq x T x S); flash or efficient takes it.
    k4, v4 = repeat_kv_heads(k4, group), repeat_kv_heads(v4, group)
    if not any(_can_use(kind, q4, k4, v4, flag, False) for kind in ("flash", "efficient")):
        raise RuntimeError(
            f"no fused attention kernel takes {q.dtype} q {tuple(q.shape)} on {q.device}: the "
            "math kernel would build [heads, T, S] scores; use bf16/fp16 and head_dim <= 256"
        )
    with sdpa_kernel(FUSED_BACKENDS):
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal,
                                             scale=scale)
    return out[0]
