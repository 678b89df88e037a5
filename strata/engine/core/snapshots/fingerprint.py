"""A model's identity for snapshots: its config plus the identity of its weight files.

Two models with the same shape but other weights must not share KV, so the config alone is not
enough. Hashing every weight byte would cost seconds per GiB at load, so each file contributes
its name, its size and a hash of its first and last MiB: different training runs, quantizations
or fine-tunes differ there, and a re-copied identical file keeps its fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from strata.engine.core.model_config import ModelConfig

_SAMPLE_BYTES = 1 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def _weight_files(model_path: Path) -> list[Path]:
    if model_path.is_file():
        return [model_path]
    return sorted(p for p in model_path.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))


def _file_identity(path: Path, digest: hashlib._Hash) -> None:
    size_bytes = path.stat().st_size
    digest.update(f"{path.name}:{size_bytes}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE_BYTES))
        if size_bytes > 2 * _SAMPLE_BYTES:
            f.seek(size_bytes - _SAMPLE_BYTES)
        digest.update(f.read(_SAMPLE_BYTES))


def model_fingerprint(model_path: str | os.PathLike[str], config: ModelConfig) -> str:
    """A hex digest naming this exact model: config, weight file names, sizes and sampled bytes."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    for path in _weight_files(Path(model_path)):
        _file_identity(path, digest)
    return digest.hexdigest()
