"""Where a model's weights come from at load: a model file, or seeded random values.

Both sources fill tensors the engine has already laid out in its arenas (`fill`) and hand over
a layer's stacked experts for the expert store (`experts`), one tensor or layer at a time, so
neither a model file nor a random model of any size is ever copied whole on the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Iterator, Mapping

import torch
from gguf import GGMLQuantizationType

from strata.engine.core.loader import open_tensors
from strata.engine.core.loader.lazy import BlockTensor, LazyTensor, StackedTensor, as_lazy
from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.build import check_tensors
from strata.engine.core.quant.weight import block_shape
from strata.engine.core.random_weights import DEFAULT_STD

ExpertTriple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down
ExpertNames = tuple[str, str, str]


class FileWeights:
    """A model file's canonical tensors, unread (loader/lazy.py): each is read from the mapped
    file in its own dtype when asked for and cast once by the copy into place, so the host
    never holds more than one tensor (or one layer's stacked experts) beyond the page cache.
    Quantized GGUF tensors can also hand over their blocks as stored (`fill_blocks`)."""

    fills_host = True  # the engine fills the host copy from the file, then copies it up

    def __init__(self, tensors: Mapping[str, LazyTensor | torch.Tensor]):
        self._tensors: dict[str, LazyTensor] = {name: as_lazy(t) for name, t in tensors.items()}

    @classmethod
    def open(cls, path: str | os.PathLike[str], config: ModelConfig) -> FileWeights:
        """The weights of a .gguf file or a Hugging Face directory, headers read, data not."""
        return cls(open_tensors(path, config))

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise ModelFormatError for a missing, unexpected or misshapen tensor (headers only)."""
        check_tensors(expected, self._tensors)

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Copy tensor `name` into dst (casting to its dtype and device), then drop the source."""
        self._tensors.pop(name).copy_to(dst)

    def quant_type(self, name: str) -> GGMLQuantizationType | None:
        """The GGML type of a quantized GGUF tensor (for stacked experts, of their parts), else
        None (a float tensor)."""
        lazy = self._tensors.get(name)
        if isinstance(lazy, StackedTensor):  # experts: the type they are stored in
            lazy = lazy.parts[0]
        return lazy.qtype if isinstance(lazy, BlockTensor) else None

    def fill_blocks(self, name: str, dst: torch.Tensor) -> None:
        """Copy tensor `name`'s GGML blocks as stored into dst (uint8 [..., rows, row_bytes])."""
        _copy_blocks(self._tensors.pop(name), dst)

    def experts(
        self,
        names_by_layer: dict[int, ExpertNames],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        quantized: bool = False,
    ) -> Mapping[int, ExpertTriple]:
        """A layer -> (gate, up, down) mapping of unread handles that copy themselves into
        ExpertStore's host copy, each expert read from the file once: cast to `dtype`, or
        (quantized) as their GGML blocks, reporting qtype and uint8 [E, N, row_bytes]."""
        return _LazyFileExperts(self._tensors, names_by_layer, dtype, quantized)


class _LazyFileExperts(Mapping):
    def __init__(
        self, tensors: dict[str, LazyTensor], names: dict[int, ExpertNames], dtype: torch.dtype,
        quantized: bool = False,
    ):
        self._tensors = tensors
        self._names = names
        self._dtype = dtype
        self._quantized = quantized

    def __getitem__(self, layer: int) -> ExpertTriple:
        # Handles, not tensors: ExpertStore checks their shapes and dtype (headers only), then
        # has each one copy itself into its host-copy view, so every byte is read from the file
        # once and no stacked [E, ...] tensor exists besides the host copy.
        kind = _BlocksOnCopy if self._quantized else _CastOnCopy
        return tuple(kind(self._tensors[name], self._dtype)  # type: ignore[return-value]
                     for name in self._names[layer])

    def __iter__(self) -> Iterator[int]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class _CastOnCopy:
    """A lazy tensor that reports the dtype it will be cast to: what ExpertStore checks."""

    def __init__(self, lazy: LazyTensor, dtype: torch.dtype):
        self.lazy = lazy
        self.shape = lazy.shape
        self.dtype = dtype

    def copy_to(self, dst: torch.Tensor) -> None:
        self.lazy.copy_to(dst)


class _BlocksOnCopy:
    """A stacked quantized GGUF tensor's blocks as stored: what ExpertStore keeps."""

    def __init__(self, lazy: LazyTensor, dtype: torch.dtype):
        part = lazy.parts[0] if isinstance(lazy, StackedTensor) else lazy
        if not isinstance(part, BlockTensor):
            raise TypeError(f"{type(part).__name__} has no GGML blocks")
        self.lazy = lazy
        self.qtype = part.qtype
        self.logical_shape = tuple(lazy.shape)
        self.shape = block_shape(self.qtype, self.logical_shape)
        self.dtype = torch.uint8

    def copy_to(self, dst: torch.Tensor) -> None:
        _copy_blocks(self.lazy, dst)


def _copy_blocks(lazy: LazyTensor, dst: torch.Tensor) -> None:
    """A GGUF tensor's blocks into dst; stacked per-expert tensors (old Mixtral files) part by
    part into dst's rows."""
    if isinstance(lazy, StackedTensor):
        for row, part in zip(dst, lazy.parts):
            _copy_blocks(part, row)
        return
    dst.copy_(lazy.read_blocks())


class RandomWeights:
    """Seeded normal(0, std) weights (norms at 1), made on `device`; one seed per tensor name,
    so a tensor's values do not depend on the order it is asked for in."""

    def __init__(self, device: torch.device, seed: int = 0, std: float = DEFAULT_STD):
        self.device = device
        self.seed = seed
        self.std = std

    fills_host = False  # made on the device: the host copy is taken from the arena

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Random weights have every tensor the model expects, by construction."""

    def quant_type(self, name: str) -> None:
        """Random weights are float."""
        return

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        return generator

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Fill dst in place (no host copy of a random model ever exists)."""
        if name.endswith("norm.weight"):
            dst.fill_(1.0)
        else:
            dst.normal_(0.0, self.std, generator=self._generator(name, dst.device))

    def experts(
        self,
        names_by_layer: dict[int, ExpertNames],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
    ) -> Mapping[int, ExpertTriple]:
        """A lazy layer -> (gate, up, down) mapping: each access makes that layer again (same
        values), on the device where random numbers are cheap, so only one layer exists at once."""
        return _LazyRandomExperts(self, names_by_layer, shapes, dtype)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=self.device)
        self.fill(name, out)
        return out


class _LazyRandomExperts(Mapping):
    def __init__(
        self,
        source: RandomWeights,
        names: dict[int, ExpertNames],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
    ):
        self._source = source
        self._names = names
        self._shapes = shapes
        self._dtype = dtype

    def __getitem__(self, layer: int) -> ExpertTriple:
        return tuple(  # type: ignore[return-value]
            self._source.tensor(n, self._shapes[n], self._dtype) for n in self._names[layer]
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def random_fingerprint(config: ModelConfig, seed: int, std: float) -> str:
    """A snapshot fingerprint for a random model: its shape and how its values were drawn."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    digest.update(f"random-weights seed={seed} std={std}".encode())
    return digest.hexdigest()
