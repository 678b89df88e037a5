"""The models Strata can run: GGUF files and Hugging Face directories under a models directory.

Host side (no torch): details come from file headers only (`inspect_model`). The embedded
default model is always listed, downloaded or not.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from strata.default_model import DEFAULT_MODEL_FILENAME
from strata.errors import StrataError
from strata.paths import model_cache_dir

log = logging.getLogger(__name__)
DEFAULT_MODEL_NAME = DEFAULT_MODEL_FILENAME.removesuffix(".gguf")


class LibraryError(StrataError, ValueError):
    """A model that is not in the library, or a library that cannot be changed that way."""


@dataclass(frozen=True)
class ModelEntry:
    """One model of the library, described from its header."""

    name: str  # what requests, `strata rm` and the tray call it
    path: Path
    format: str  # gguf | hf
    size_bytes: int
    architecture: str
    quantization: str  # the most used tensor type (Q4_K, BF16, ...)
    parameter_count: int
    context_tokens: int
    is_default: bool = False
    is_downloaded: bool = True


def _size_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(path: Path, name: str, *, is_default: bool = False) -> ModelEntry:
    """An entry for a model file or directory; a header Strata cannot read is still listed."""
    from strata.engine.core.loader import inspect_model  # host-safe: reads headers only
    from strata.engine.core.model_config import ModelFormatError

    fmt = "gguf" if path.suffix == ".gguf" else "hf"
    try:
        info = inspect_model(path)
    except (ModelFormatError, OSError, ValueError) as exc:
        log.warning("model %s: header unreadable (%s)", path.name, exc)
        return ModelEntry(name, path, fmt, _size_bytes(path), "unknown", "", 0, 0, is_default)
    quant = max(info.quant_types, key=info.quant_types.get) if info.quant_types else ""
    return ModelEntry(name=name, path=path, format=info.format, size_bytes=_size_bytes(path),
                      architecture=info.model_type, quantization=quant,
                      parameter_count=info.parameter_count,
                      context_tokens=info.context_tokens, is_default=is_default)


def _candidates(models_dir: Path) -> list[tuple[str, Path]]:
    """(name, path) of every GGUF file and HF directory below models_dir."""
    found: list[tuple[str, Path]] = []
    if not models_dir.is_dir():
        return found
    for config in sorted(models_dir.rglob("config.json")):
        folder = config.parent
        if any(folder.glob("*.safetensors")) and ".cache" not in folder.parts:
            found.append((folder.relative_to(models_dir).as_posix(), folder))
    stems: dict[str, int] = {}
    ggufs = sorted(p for p in models_dir.rglob("*.gguf")
                   if ".cache" not in p.relative_to(models_dir).parts)
    for path in ggufs:
        stems[path.stem] = stems.get(path.stem, 0) + 1
    for path in ggufs:
        # The file's stem names it; the same stem twice is told apart by its folder.
        name = path.stem if stems[path.stem] == 1 else \
            path.relative_to(models_dir).with_suffix("").as_posix()
        found.append((name, path))
    return found


def scan(models_dir: Path | None = None) -> list[ModelEntry]:
    """Every model under models_dir (default: the model cache), the default model first."""
    models_dir = models_dir or model_cache_dir()
    entries = [describe(path, name, is_default=(path.name == DEFAULT_MODEL_FILENAME))
               for name, path in _candidates(models_dir)]
    if not any(e.is_default for e in entries):
        default_path = model_cache_dir() / DEFAULT_MODEL_FILENAME
        if default_path.is_file():
            entries.append(describe(default_path, DEFAULT_MODEL_NAME, is_default=True))
        else:  # listed all the same: the first use fetches it
            entries.append(ModelEntry(DEFAULT_MODEL_NAME, default_path, "gguf", 0, "llama",
                                      "Q4_1", 0, 0, is_default=True, is_downloaded=False))
    return sorted(entries, key=lambda e: (not e.is_default, e.name.lower()))


def find(name: str, models_dir: Path | None = None) -> ModelEntry:
    """The entry called name (a ':latest' tag is ignored), else a LibraryError naming them."""
    entries = scan(models_dir)
    wanted = name.removesuffix(":latest")
    for entry in entries:
        if wanted in (entry.name, entry.path.name):
            return entry
    names = ", ".join(e.name for e in entries)
    raise LibraryError(f"no model {name!r} in the library; have: {names} "
                       "(`strata list`, `strata pull REPO`)")


def remove(name: str, models_dir: Path | None = None) -> ModelEntry:
    """Delete a model's file or directory from the library; empty parent folders go too."""
    models_dir = models_dir or model_cache_dir()
    entry = find(name, models_dir)
    if not entry.is_downloaded:
        raise LibraryError(f"{entry.name} is not downloaded; nothing to remove")
    if entry.path.is_dir():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink()
    # Folders left with nothing but huggingface_hub's download records go too.
    parent = entry.path.parent
    while (parent != models_dir and models_dir in parent.parents
           and all(p.name == ".cache" for p in parent.iterdir())):
        shutil.rmtree(parent)
        parent = parent.parent
    return entry
