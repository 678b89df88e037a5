"""Quantized weights in GGUF block format, and the one function linear layers call: qlinear.

A QuantizedWeight is a view of raw blocks [N, row_bytes] (uint8, usually in the weights
arena) with its GGML type and logical shape [N, K]. `qlinear(x, w, bias)` multiplies:
- up to MAX_DECODE_TOKENS rows of x: the fused dequant-GEMM (kernels.quant_matmul), reading
  each block once;
- more (prefill): the weight is dequantized into a scratch buffer reused by every layer, then
  multiplied by torch (cuBLAS on a GPU); a matrix larger than SCRATCH_PIECE_BYTES goes in
  pieces of rows, each product written into its columns of the output.
The scratch is reserved at load for the largest piece (`reserve_scratch`), so a prefill
captured in a CUDA graph never allocates; it grows outside graphs if ever needed.
`apply_linear` takes a float tensor or a QuantizedWeight alike, for code that reads `.weight`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

if TYPE_CHECKING:
    from types import ModuleType

log = logging.getLogger(__name__)

_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# Tokens up to which qlinear takes the fused kernel (kernels.MAX_DECODE_TOKENS, checked there).
MAX_DECODE_TOKENS = 16
# Most bytes of one dequantized piece of a prefill's matrix: Llama-3-8B's fused gate/up is
# 224 MiB in bf16, VRAM held for every prefill's 0.1 ms; in pieces of 64 MiB the GEMMs
# still have 8192 output columns, enough tiles for every SM at 512 tokens.
SCRATCH_PIECE_BYTES = 64 << 20
PIECE_ROW_MULTIPLE = 256  # rows per piece: whole GEMM tiles


def _kernels() -> ModuleType:
    """quant/kernels.py, imported on first use: importing it decorates Triton kernels, which
    must wait until a test has chosen the CPU interpreter (models/build.py imports this)."""
    from strata.engine.core.quant import kernels

    return kernels


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A [N, K] matrix held as GGML blocks; products come out in `dtype` (the compute dtype)."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # logical [N, K]
    raw: torch.Tensor  # uint8 [N, row_bytes]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        block_size, block_bytes = GGML_QUANT_SIZES[self.qtype]
        rows, cols = self.shape
        expected = (rows, cols // block_size * block_bytes)
        if cols % block_size or tuple(self.raw.shape) != expected or self.raw.dtype != torch.uint8:
            raise ValueError(f"{self.qtype.name} blocks for a [{rows}, {cols}] matrix must be "
                             f"uint8 {expected}, got {self.raw.dtype} {tuple(self.raw.shape)}")

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole matrix [N, K] in the compute dtype."""
        return _kernels().dequantize(self.raw, self.qtype, self.shape[1], self.dtype, out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] dequantized, [T, K]: an embedding lookup reads only those blocks."""
        picked = self.raw.index_select(0, ids)  # [T, row_bytes]
        return _kernels().dequantize(picked, self.qtype, self.shape[1], self.dtype,
                                     gathered=True)


def is_quantized(weight: object) -> bool:
    return isinstance(weight, QuantizedWeight)


def block_shape(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The uint8 [..., rows, row_bytes] a [..., rows, cols] tensor of qtype takes as blocks."""
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    return (*shape[:-1], shape[-1] // block_size * block_bytes)


def keeps_quantized_blocks(device: torch.device) -> bool:
    """Whether quantized weights stay in their blocks on `device`: on CUDA unless
    STRATA_QUANTIZED=0; on the CPU only with STRATA_QUANTIZED=1 and the Triton interpreter
    (tests of the same kernels), since the CPU path dequantizes at load."""
    from strata.engine.core.kernels import launch

    setting = os.environ.get("STRATA_QUANTIZED")
    if setting == "0" or not launch.is_usable(device):
        return False
    return device.type == "cuda" or setting == "1"


def blocks_notice(device: torch.device) -> str | None:
    """The one-line notice when `device` would keep GGUF blocks (CUDA; the CPU with
    STRATA_QUANTIZED=1) but Triton cannot run here, so they are expanded at load; else None."""
    from strata.engine.core.kernels import launch
    from strata.engine.triton_support import NO_TRITON_NOTICE

    setting = os.environ.get("STRATA_QUANTIZED")
    wanted = setting != "0" and (device.type == "cuda" or setting == "1")
    return NO_TRITON_NOTICE if wanted and not launch.is_usable(device) else None


def row_pieces(w: QuantizedWeight) -> list[tuple[int, int]]:
    """The row ranges [n0, n1) a prefill dequantizes w in: one piece of at most
    SCRATCH_PIECE_BYTES (whole PIECE_ROW_MULTIPLE rows), or the whole matrix if it fits."""
    num_rows, num_cols = w.shape
    fitting = SCRATCH_PIECE_BYTES // (num_cols * w.dtype.itemsize)
    rows = max(PIECE_ROW_MULTIPLE, fitting // PIECE_ROW_MULTIPLE * PIECE_ROW_MULTIPLE)
    if rows >= num_rows:
        return [(0, num_rows)]
    return [(n0, min(num_rows, n0 + rows)) for n0 in range(0, num_rows, rows)]


def prefill_scratch_numel(model: nn.Module) -> int:
    """The most values a prefill dequantizes at once: the largest piece of a quantized matrix
    a layer multiplies, fused views included (the head and embeddings never need it)."""
    largest = 0
    for name, module in model.named_modules():
        for attr in ("weight", "qkv_weight", "gate_up_weight"):
            weight = getattr(module, attr, None)
            if isinstance(weight, QuantizedWeight) and name not in ("lm_head",
                                                                    "model.embed_tokens"):
                largest = max(largest, max(n1 - n0 for n0, n1 in row_pieces(weight))
                              * weight.shape[1])
    return largest


def _scratch_key(device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """One scratch per GPU: "cuda" names the current one, as a tensor's device "cuda:0" does."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype


def reserve_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> None:
    """Make the prefill scratch hold at least numel values (called at load, before graphs)."""
    key = _scratch_key(device, dtype)
    current = _scratch.get(key)
    if current is None or current.numel() < numel:
        _scratch[key] = torch.empty(numel, dtype=dtype, device=device)


def release_scratch() -> None:
    """Drop every scratch buffer (unload; torch's allocator then frees it)."""
    _scratch.clear()


def scratch_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in _scratch.values())


def scratch_tensor(device: torch.device, dtype: torch.dtype,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """A view of the prefill scratch of `shape`; the next user overwrites it."""
    numel = torch.Size(shape).numel()
    key = _scratch_key(device, dtype)
    if key not in _scratch or _scratch[key].numel() < numel:
        log.debug("quantized prefill scratch grows to %d values", numel)
        reserve_scratch(device, dtype, numel)
    return _scratch[key][:numel].view(shape)


def _dequantized_piece(w: QuantizedWeight, n0: int, n1: int) -> torch.Tensor:
    """Rows n0..n1-1 of w dequantized into the scratch, [n1 - n0, K]."""
    out = scratch_tensor(w.device, w.dtype, (n1 - n0, w.shape[1]))
    return _kernels().dequantize(w.raw[n0:n1], w.qtype, w.shape[1], w.dtype, out)


def _prefill_linear(x2: torch.Tensor, w: QuantizedWeight,
                    bias: torch.Tensor | None) -> torch.Tensor:
    pieces = row_pieces(w)
    if len(pieces) == 1:
        return F.linear(x2, _dequantized_piece(w, 0, w.shape[0]).to(x2.dtype), bias)
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x2.dtype, device=x2.device)
    for n0, n1 in pieces:  # stream order: a piece's GEMM reads the scratch before the next
        # A column slice (row stride N) is a matrix cuBLAS writes in place.
        torch.mm(x2, _dequantized_piece(w, n0, n1).to(x2.dtype).t(), out=out[:, n0:n1])
    if bias is not None:
        out += bias
    return out


def qlinear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
            use_pdl: bool = False, rounded: tuple | None = None) -> torch.Tensor:
    """F.linear(x, W, bias) for x [..., K] and W held as blocks; out in x's dtype. use_pdl:
    a one-token dp4a product launches as a PDL secondary (gemv_dp4a.matmul); rounded: x's
    int8 rounding made with x (fast/decode_rounded.py), read by that product."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.shape[1])  # [M, K]
    if x2.shape[0] <= MAX_DECODE_TOKENS:
        out = _kernels().quant_matmul(x2, w.raw, w.qtype, w.shape[0], bias, use_pdl, rounded)
    else:
        out = _prefill_linear(x2, w, bias)
    return out.view(*lead, w.shape[0])


def apply_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                 use_pdl: bool = False, rounded: tuple | None = None) -> torch.Tensor:
    """F.linear for a float weight, qlinear (use_pdl, rounded as there) for a
    QuantizedWeight."""
    if isinstance(weight, QuantizedWeight):
        return qlinear(x, weight, bias, use_pdl, rounded)
    return F.linear(x, weight, bias)


class QuantizedLinear(nn.Module):
    """nn.Linear over a QuantizedWeight; the bias (if any) stays a float parameter."""

    def __init__(self, weight: QuantizedWeight, has_bias: bool, bias_device="meta"):
        super().__init__()
        self.weight = weight  # a plain attribute: not a parameter, never in state_dict
        self.out_features, self.in_features = weight.shape
        self.bias = (nn.Parameter(torch.empty(weight.shape[0], device=bias_device),
                                  requires_grad=False) if has_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.weight, self.bias)


class QuantizedEmbedding(nn.Module):
    """nn.Embedding over a QuantizedWeight: a lookup dequantizes the rows it reads."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)


def install_quantized(model: nn.Module, weights: dict) -> None:
    """Swap the nn.Linear / nn.Embedding owning each `<module>.weight` name for its quantized
    twin, and put stacked experts' blocks (quant/experts.py) in place of their parameter (on a
    model still on the meta device, before its other tensors are assigned)."""
    for name, weight in weights.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Parameter) and not isinstance(weight, QuantizedWeight):
            del parent._parameters[attr]  # a plain attribute from now on, never in state_dict
            setattr(parent, attr, weight)
            continue
        if isinstance(old, nn.Linear):
            new: nn.Module = QuantizedLinear(weight, old.bias is not None)
        elif isinstance(old, nn.Embedding):
            new = QuantizedEmbedding(weight)
        else:
            raise TypeError(f"{name} belongs to a {type(old).__name__}, which has no "
                             "quantized form")
        setattr(parent, attr, new)


@torch.inference_mode()
def warm_up_quantized(model: nn.Module) -> int:
    """Compile (and on CUDA autotune) every quantized kernel variant this model will launch,
    with zeros, before any CUDA graph is captured: a graph cannot hold a compile or a timing
    run. Covers 1 and 2..16 tokens, the prefill's dequantization, embedding rows, with and
    without bias. Returns how many variants ran."""
    seen: set[tuple] = set()
    for name, module in model.named_modules():
        uses = []
        if isinstance(module, QuantizedLinear):
            uses.append((module.weight, module.bias, name != "lm_head"))
        elif isinstance(module, QuantizedEmbedding):
            module(torch.zeros(1, dtype=torch.long, device=module.weight.device))
            # A tied head multiplies by the embedding's blocks, one token at a time.
            uses.append((module.weight, None, False))
        if isinstance(getattr(module, "qkv_weight", None), QuantizedWeight):
            uses.append((module.qkv_weight, module.qkv_bias, True))
        if isinstance(getattr(module, "gate_up_weight", None), QuantizedWeight):
            uses.append((module.gate_up_weight, None, True))
        _warm_up_pair(module, seen)
        for weight, bias, prefills in uses:
            # The blocks' alignment picks the dequantizer's kernel (dequant.kernel_for).
            key = (weight.qtype, weight.shape, bias is not None, prefills,
                   weight.raw.data_ptr() % 4)
            if key in seen:
                continue
            seen.add(key)
            for num_tokens in (1, MAX_DECODE_TOKENS):
                qlinear(torch.zeros(num_tokens, weight.shape[1], dtype=weight.dtype,
                                    device=weight.device), weight, bias)
            if prefills:
                for n0, n1 in row_pieces(weight):
                    _dequantized_piece(weight, n0, n1)
    return len(seen)


def _warm_up_pair(attn: nn.Module, seen: set[tuple]) -> None:
    """One token through attn's q/k/v pair (fused_views.adjacent_pair), if decode takes it."""
    pair = getattr(attn, "qkv_pair", None)
    if pair is None:
        return
    from strata.engine.core.quant import gemv_dp4a

    bias = attn.qkv_bias
    x = torch.zeros(1, pair.num_cols, dtype=attn.q_proj.weight.dtype, device=pair.raw.device)
    key = ("pair", pair.qtypes, pair.rows, pair.num_cols, bias is not None)
    if key not in seen and gemv_dp4a.is_pair_enabled(x):
        seen.add(key)
        gemv_dp4a.matmul_pair(x, pair, bias)


def compute_dtype(module: nn.Module) -> torch.dtype:
    """The dtype a module computes in: its first float weight's, or a quantized weight's
    compute dtype (a module of QuantizedLinears, e.g. a Llama attention block, has no
    parameters at all)."""
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, QuantizedWeight):
            return weight.dtype
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            return weight.dtype
    raise ValueError(f"{type(module).__name__} has no weight to take a dtype from")
