"""Building blocks shared by every architecture: RMSNorm, RoPE, GQA attention, SwiGLU MLP,
and Gemma's variants (GemmaRMSNorm, GeGLU; attention's sliding window and scale).

Tensors are unbatched: one sequence of T tokens, `x [T, hidden]`. Attention writes its K/V
into the layer's KVCache buffers and attends over every cached position up to the newest.
`Attention.decode_batch` is the one exception: one new token of each of B sequences, each
attending over its own cache.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from strata.engine.core.kernels.prefill_attention import flash_attention
from strata.engine.core.model_config import ModelConfig, ModelFormatError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 like the reference."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight w is stored centred on 0 and applied as (1 + w), in float32
    before the cast back (Llama casts first, then multiplies)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def _rope_type(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inverse_frequencies(config: ModelConfig, factors: str = "short") -> torch.Tensor:
    """RoPE inverse frequencies [rotary_dim / 2] (float32, CPU), with the config's scaling.

    `factors` picks LongRoPE's set (short or long); other scalings have one set."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling or {}
    rope_type = _rope_type(config)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling, config.max_position_embeddings)
    if rope_type == "longrope":
        # Phi-3/4 (transformers' _compute_longrope_parameters): one divisor per frequency.
        ext = torch.tensor(scaling[f"{factors}_factor"], dtype=torch.float32, device="cpu")
        if ext.shape != inv_freq.shape:
            raise ModelFormatError(
                f"longrope {factors}_factor has {ext.numel()} values but RoPE rotates "
                f"{inv_freq.numel()} frequencies: the config is inconsistent")
        return 1.0 / (ext * config.rope_theta**exponents)
    if rope_type == "yarn":
        return _yarn_scaled(inv_freq, scaling, config)
    raise ModelFormatError(
        f"RoPE scaling type {rope_type!r} is not supported: Strata runs "
        f"{', '.join(SUPPORTED_ROPE_TYPES)} RoPE; pick a model without it"
    )


def longrope_attention_factor(config: ModelConfig) -> float:
    """LongRoPE's cos/sin multiplier: given, else from the context ratio (transformers)."""
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict, max_positions: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Meta's reference, also what transformers computes).
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", max_positions))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def partial_rotary_rows(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order [head_dim] that turns a head with partial RoPE into a full-width one.

    HF rotates dims [0, r) as pairs (i, i + r/2) and passes [r, D) through. Reordered, the
    rotated pairs sit at (j, j + D/2) for j < r/2, the half-split layout every Strata kernel
    uses, and the passed dims fill the rest, where RotaryEmbedding puts frequency 0. q and k
    get the same order, so their dot products, and attention, are unchanged.
    """
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rotated_pass = torch.arange(rotary_dim, head_dim)
    return torch.cat([torch.arange(half_rot), rotated_pass[:half_pass],
                      torch.arange(half_rot, rotary_dim), rotated_pass[half_pass:]])


def reorder_partial_rotary(tensors: dict, config: ModelConfig) -> dict:
    """Under partial RoPE, every per-head-dim tensor of q and k (projection rows and biases,
    q/k norm weights) in partial_rotary_rows order, so full-width RoPE tables rotate the right
    pairs; a no-op for full RoPE. Lazy tensors stay lazy (quantized rows move whole)."""
    from strata.engine.core.loader.lazy import rows_of

    if config.rotary_dim == config.head_dim:
        return tensors
    order = partial_rotary_rows(config.head_dim, config.rotary_dim)
    pattern = re.compile(r"\.self_attn\.([qk]_proj\.(weight|bias)|[qk]_norm\.weight)$")
    for name in [n for n in tensors if pattern.search(n)]:
        heads = tensors[name].shape[0] // config.head_dim
        rows = (torch.arange(heads)[:, None] * config.head_dim + order).reshape(-1)
        tensors[name] = rows_of(tensors[name], rows)
    return tensors


def _yarn_factor(scaling: dict, config: ModelConfig) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-style configs give the two context lengths instead
        return config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_scaled(inv_freq: torch.Tensor, scaling: dict, config: ModelConfig) -> torch.Tensor:
    # YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the
    # original context are divided by `factor`, those turning more than beta_fast times are
    # kept, a linear ramp over the dimensions between (transformers' _compute_yarn_parameters).
    dim = config.rotary_dim
    factor = _yarn_factor(scaling, config)
    original = float(scaling.get("original_max_position_embeddings",
                                 config.max_position_embeddings))
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(
            config.rope_theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    dims = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 where the frequency is kept (extrapolated)
    return (inv_freq / factor) * (1 - kept) + inv_freq * kept


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's temperature 0.1 * ln(factor) + 1 (or
    the config's attention_factor, or the mscale ratio DeepSeek's configs give); else 1."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, config)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [T, head_dim] for given positions; frequencies stay float32 whatever the
    model dtype. Partial RoPE pads the frequencies with zeros (see partial_rotary_rows);
    LongRoPE switches to its long factors once a call reaches past the pre-training context
    (transformers' rule) and scales the rotated dims' cos/sin by its attention factor."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim or self.rotary_dim <= 0:
            raise ModelFormatError(
                f"RoPE over {self.rotary_dim} of {self.head_dim} head dims is not possible: "
                "partial_rotary_factor must leave an even count; the config is inconsistent")
        # Not persistent: derived from the config, never read from or written to a file.
        self.register_buffer("inv_freq", self._padded(rope_inverse_frequencies(config)),
                             persistent=False)
        self.is_longrope = _rope_type(config) == "longrope"
        self.attention_factor = rope_attention_factor(config)  # YaRN's; else 1
        self.original_positions = 0
        if self.is_longrope:
            self.register_buffer(
                "long_inv_freq", self._padded(rope_inverse_frequencies(config, "long")),
                persistent=False)
            self.attention_factor = longrope_attention_factor(config)
            self.original_positions = int(config.rope_scaling["original_max_position_embeddings"])

    def _padded(self, inv_freq: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros((self.head_dim - self.rotary_dim) // 2, dtype=inv_freq.dtype,
                            device=inv_freq.device)
        return torch.cat([inv_freq, zeros])  # [D/2]

    def forward(self, positions: torch.Tensor, per_row: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T] of one sequence's call, or (per_row) of T
        sequences' single tokens: LongRoPE then picks its factors per row, as each
        sequence's own call would."""
        inv_freq = self.inv_freq[None, :]  # [1, D/2]
        if self.is_longrope:
            reach = positions[:, None] if per_row else positions.max().reshape(1, 1)
            inv_freq = torch.where(reach + 1 > self.original_positions,
                                   self.long_inv_freq[None, :], inv_freq)  # [T or 1, D/2]
        freqs = positions.float()[:, None] * inv_freq  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            # Only the rotated dims are scaled; the passed-through ones keep cos 1, sin 0.
            is_rotated = torch.arange(cos.shape[-1], device=cos.device) < self.rotary_dim // 2
            cos = torch.where(is_rotated, cos * self.attention_factor, cos)
            sin = sin * self.attention_factor
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [T, D] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by position (HF layout: the two halves of D form the pairs).
    Partial RoPE needs nothing here: its heads' rows are reordered at load
    (reorder_partial_rotary) and the passed-through dims get frequency 0."""
    cos = cos[:, None, :].to(x.dtype)  # [T, 1, D]
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def llama4_query_scales(positions: torch.Tensor, beta: float, period_tokens: int
                        ) -> torch.Tensor:
    """Llama 4's attention temperature (Ministral 3): the factor [T] float32 the queries at
    positions [T] are scaled by, 1 + beta * ln(1 + floor(p / period)); 1 in the first period.
    Device ops only, so a CUDA graph captures it with the positions tensor."""
    return 1.0 + beta * torch.log1p(torch.floor(positions.float() / period_tokens))


class Attention(nn.Module):
    """Grouped-query attention over the KV cache, with optional q/k biases and q/k RMSNorm.

    Gemma 3's extras: `norm` (the q/k norm's class), `scale` (the scores' factor, None for
    1/sqrt(head_dim)) and `sliding_window` (a query sees only the newest that many positions,
    itself included; None: all of them). Ministral 3's: `llama4_scaling` (beta, period in
    tokens) scales the rotated queries by position (llama4_query_scales); None: no scaling."""

    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, *,
                 norm: type[RMSNorm] = RMSNorm, scale: float | None = None,
                 sliding_window: int | None = None,
                 llama4_scaling: tuple[float, int] | None = None):
        super().__init__()
        if llama4_scaling is not None and qk_norm:
            # The fast decode kernels rotate after a q norm; they scale q before both, which
            # equals scaling after RoPE (linear) but not after a norm.
            raise ModelFormatError("a query temperature (llama_4_scaling_beta) with q/k norms "
                                   "is not supported")
        self.scale = scale
        self.sliding_window = sliding_window
        self.llama4_scaling = llama4_scaling
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=o_bias)
        # Qwen3 normalises each head of q and k before RoPE.
        self.q_norm = norm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = norm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        end_pos = start_pos + num_tokens
        q, k, v = self._project(x, cos, sin)
        q = self.scale_queries(q, range(start_pos, end_pos))
        k_cache[start_pos:end_pos] = k
        v_cache[start_pos:end_pos] = v
        out = self._attend(q, k_cache, v_cache, end_pos)  # [Hq, T, D]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))

    def decode_batch(
        self,
        x: torch.Tensor,
        positions: Sequence[int],
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One new token per sequence: x [B, hidden], row b at positions[b] of its own caches.

        The projections run on all B rows at once; attention runs per sequence, each over its
        own cached positions only, so sequences never see each other's keys."""
        batch = x.shape[0]
        q, k, v = self._project(x, cos, sin)  # [B, H, D] each
        q = self.scale_queries(q, positions)
        outs = []
        for b, position in enumerate(positions):
            k_caches[b][position] = k[b]
            v_caches[b][position] = v[b]
            outs.append(self._attend(q[b : b + 1], k_caches[b], v_caches[b], position + 1))
        out = torch.cat(outs, dim=1)  # [Hq, B, D]
        return self.o_proj(out.transpose(0, 1).reshape(batch, -1))

    def scale_queries(self, q: torch.Tensor, positions: torch.Tensor | Sequence[int]
                      ) -> torch.Tensor:
        """q [T, ...] (one row per position of positions [T]: a device tensor, which graphs
        capture, or host ints such as a range) times its llama4_scaling factor, in q's dtype
        as transformers multiplies; q itself without that scaling, building nothing."""
        if self.llama4_scaling is None:
            return q
        if isinstance(positions, range):
            positions = torch.arange(positions.start, positions.stop, device=q.device)
        elif not isinstance(positions, torch.Tensor):
            positions = torch.tensor(list(positions), device=q.device)
        scales = llama4_query_scales(positions, *self.llama4_scaling).to(q.dtype)  # [T]
        return q * scales.view(-1, *([1] * (q.dim() - 1)))

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D] of rows x [T, hidden], RoPE applied per row."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                end_pos: int) -> torch.Tensor:
        """Causal attention of q [T, Hq, D] (the last T of end_pos positions): [Hq, T, D]."""
        keys = k_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
        values = v_cache[:end_pos].transpose(0, 1).to(q.dtype)  # [Hkv, S, D]
        # 4-D fused kernels with a lower-right causal mask: the 3-D / explicit-mask form of SDPA
        # falls to the math kernel, which materialises [heads, T, S] scores (20 GiB at 32k).
        return flash_attention(q.transpose(0, 1), keys, values, scale=self.scale,
                               window=self.sliding_window)  # [Hq, T, D]


class GatedMLP(nn.Module):
    """gate, up and down projections without biases: what SwiGLU and GeGLU share."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)


class SwiGLU(GatedMLP):
    """The dense feed-forward block: down(silu(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeGLU(GatedMLP):
    """Gemma's feed-forward block: down(gelu_tanh(gate(x)) * up(x)). Not a SwiGLU: the fast
    path recognises SwiGLU by type and would apply SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
