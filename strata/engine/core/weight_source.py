"""Where a model's weights come from at load: a model file, or seeded random values.

Both sources fill tensors the engine has already laid out in its arenas (`fill`) and hand over
a layer's stacked experts for the expert store (`experts`), so the loader's float32 copy is
consumed as it goes and a random model of any size never exists twice on the host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib
from collections.abc import Iterator, Mapping

import torch

from strata.engine.core.model_config import ModelConfig
from strata.engine.core.models.build import check_tensors
from strata.engine.core.random_weights import DEFAULT_STD

ExpertTriple = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # gate, up, down
ExpertNames = tuple[str, str, str]


class FileWeights:
    """The loader's canonical tensors (HF names, float32 on the CPU), consumed as they are used."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise ModelFormatError for a missing, unexpected or misshapen tensor."""
        check_tensors(expected, self._tensors)

    def fill(self, name: str, dst: torch.Tensor) -> None:
        """Copy tensor `name` into dst (casting to its dtype and device), then drop the source."""
        dst.copy_(self._tensors.pop(name))

    def experts(
        self,
        names_by_layer: dict[int, ExpertNames],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
    ) -> Mapping[int, ExpertTriple]:
        """layer -> (gate, up, down) stacked, in dtype, on the CPU; the float32 copies go."""
        return {
            layer: tuple(self._tensors.pop(n).to(dtype) for n in names)  # type: ignore[misc]
            for layer, names in names_by_layer.items()
        }


class RandomWeights:
    """Seeded normal(0, std) weights (norms at 1), made on `device`; one seed per tensor name,
    so a tensor's values do not depend on the order it is asked for in."""

    def __init__(self, device: torch.device, seed: int = 0, std: float = DEFAULT_STD):
        self.device = device
        self.seed = seed
        self.std = std

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Random weights have every tensor the model expects, by construction."""

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
