"""Tensors not read yet: shape and dtype from a file's header, data only when asked for.

The loaders hand the engine a dict of these (canonical name -> LazyTensor) so a model goes
from the file into its arena one tensor at a time, in the file's own dtype, cast once by the
final copy: no float32 copy of the whole model on the host. A safetensors file is mmapped, so
`read()` of one of its tensors is a view of the page cache, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class LazyTensor(Protocol):
    shape: tuple[int, ...]
    dtype: torch.dtype  # what read() returns, usually the file's dtype

    def read(self) -> torch.Tensor:
        """The tensor on the CPU. May be a view of a mapped file: copy it before keeping it."""

    def copy_to(self, dst: torch.Tensor) -> None:
        """Copy into dst, casting to its dtype and device, without a host copy where possible."""


class DeferredTensor:
    """A tensor that `make()` produces when read: a view into a mapped file, a dequantized
    GGUF tensor, a slice of another lazy tensor, or a tensor already in memory."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, make: Callable[[], torch.Tensor],
                 source_name: str | None = None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self._make = make
        # The tensor's name in its file where that differs from the canonical one (GGUF), so
        # an error about it can name what the user's tools show.
        self.source_name = source_name

    def read(self) -> torch.Tensor:
        return self._make()

    def copy_to(self, dst: torch.Tensor) -> None:
        dst.copy_(self.read())


class BlockTensor(DeferredTensor):
    """A tensor held as GGML blocks of type `qtype`: `read()` dequantizes it to float32 (on the
    CPU, with gguf-py), `read_blocks()` gives the blocks as stored, uint8 [..., rows, row_bytes],
    for weights that stay quantized. make_blocks: the blocks (for the base class; GGUF tensors
    override read_blocks and read)."""

    def __init__(self, shape: Sequence[int], qtype, make_blocks: Callable[[], torch.Tensor]
                 | None):
        super().__init__(shape, torch.float32, self._dequantized)
        self.qtype = qtype
        self._make_blocks = make_blocks

    def read_blocks(self) -> torch.Tensor:
        assert self._make_blocks is not None
        return self._make_blocks()

    def _dequantized(self) -> torch.Tensor:
        from gguf.quants import dequantize

        values = dequantize(self.read_blocks().numpy(), self.qtype)
        return torch.from_numpy(values.astype("float32", copy=False)).reshape(self.shape)


class StackedTensor:
    """Parts of equal shape stacked on a new first axis ([E, ...] experts); copy_to writes
    each part into its row, so the stack itself never exists in the source's dtype."""

    def __init__(self, parts: Sequence[LazyTensor]):
        if not parts:
            raise ValueError("StackedTensor needs at least one part")
        self.parts = list(parts)
        self.shape = (len(self.parts), *self.parts[0].shape)
        self.dtype = self.parts[0].dtype

    def read(self) -> torch.Tensor:
        return torch.stack([p.read() for p in self.parts])

    def copy_to(self, dst: torch.Tensor) -> None:
        for row, part in zip(dst, self.parts):
            part.copy_to(row)


def in_memory(tensor: torch.Tensor) -> DeferredTensor:
    """A tensor already in memory, behind the LazyTensor interface."""
    return DeferredTensor(tensor.shape, tensor.dtype, lambda: tensor)


def as_lazy(source: torch.Tensor | LazyTensor) -> LazyTensor:
    """source behind the LazyTensor interface: for consumers that take a file's lazy handles
    and tensors in memory alike (random weights, tests)."""
    return in_memory(source) if isinstance(source, torch.Tensor) else source


def narrowed(source: LazyTensor, dim: int, start: int, length: int) -> DeferredTensor:
    """source[..., start:start+length, ...] along `dim`, read when asked for (a view)."""
    shape = list(source.shape)
    shape[dim] = length
    return DeferredTensor(shape, source.dtype, lambda: source.read().narrow(dim, start, length))


def rows_of(source: LazyTensor, index: torch.Tensor) -> LazyTensor:
    """source[index] along its first dim, read when asked for: a view where index is one run
    of rows, a gather otherwise. A tensor of GGML blocks (loader/gguf.py) stays one, each
    row's blocks moving with it, so a fused qkv split or a row reorder stays quantized."""
    if hasattr(source, "rows_of"):
        return source.rows_of(index)
    shape = (int(index.numel()), *source.shape[1:])
    start = int(index[0]) if index.numel() else 0
    if torch.equal(index, torch.arange(start, start + index.numel())):
        return DeferredTensor(shape, source.dtype,
                              lambda: source.read().narrow(0, start, index.numel()))
    return DeferredTensor(shape, source.dtype, lambda: source.read()[index])


def materialize(
    tensors: dict[str, LazyTensor], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor read into memory of its own in `dtype`, consuming `tensors` as it goes.

    For callers that want a plain state dict (tests, parity checks); the engine never does this.
    """
    out: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        lazy = tensors.pop(name)
        out[name] = torch.empty(lazy.shape, dtype=dtype)
        lazy.copy_to(out[name])
    return out
