"""The pool's names: the library's models, the config's [models.NAME] tables with their aliases,
and the model the server was started with; how a request's `model` finds one of them.

A name matches its model as written, with Ollama's ':latest' tag, by file name with or without
'.gguf', by any alias, case-insensitively as a last resort; "default" names the default model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from strata.errors import StrataError
from strata.library.catalog import ModelEntry, describe, scan

log = logging.getLogger(__name__)
DEFAULT_NAME = "default"  # what a request may send to mean the default model
_TAG = ":latest"


class ModelsConfigError(StrataError, ValueError):
    """A [models.NAME] table that cannot be used; the message names it."""


@dataclass(frozen=True)
class ModelSpec:
    """One model a request may name."""

    name: str
    entry: ModelEntry  # the library's description (format, size, quantization, ...)
    aliases: tuple[str, ...] = ()
    is_default: bool = False

    @property
    def path(self) -> Path:
        return self.entry.path


@dataclass(frozen=True)
class Configured:
    """A [models.NAME] table: a model outside the directory (path) and/or aliases."""

    name: str
    path: Path | None
    aliases: tuple[str, ...]


def configured_models(table: Any) -> list[Configured]:
    """The config's [models] table read: {NAME: {path = "...", aliases = [...]}}."""
    if table is None:
        return []
    if not isinstance(table, Mapping):
        raise ModelsConfigError("[models] must be a table of [models.NAME] tables")
    found = []
    for name, body in table.items():
        if not isinstance(body, Mapping):
            raise ModelsConfigError(f"[models.{name}] must be a table (path, aliases)")
        unknown = sorted(set(body) - {"path", "aliases"})
        if unknown:
            raise ModelsConfigError(f"[models.{name}]: unknown key {unknown[0]!r}; "
                                    "known keys: path, aliases")
        path, aliases = body.get("path"), body.get("aliases", [])
        if path is not None and (not isinstance(path, str) or not path.strip()):
            raise ModelsConfigError(f"[models.{name}]: path must be a file or directory path")
        if isinstance(aliases, str):
            aliases = [aliases]
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a.strip()
                                                    for a in aliases):
            raise ModelsConfigError(f"[models.{name}]: aliases must be a list of names")
        found.append(Configured(str(name), Path(path).expanduser() if path else None,
                                tuple(aliases)))
    return found


def _keys(spec: ModelSpec) -> set[str]:
    keys = {spec.name, spec.path.name, *spec.aliases}
    if spec.path.suffix == ".gguf":
        keys.add(spec.path.stem)
    return keys


class ModelIndex:
    """The models by every name they answer to; built by build_index()."""

    def __init__(self, specs: Iterable[ModelSpec]):
        self.specs = list(specs)
        self.default = next((s for s in self.specs if s.is_default), None)
        self._exact: dict[str, ModelSpec] = {}
        self._folded: dict[str, ModelSpec] = {}
        for spec in self.specs:  # the default first: its names win a clash
            for key in _keys(spec):
                self._exact.setdefault(key, spec)
                self._folded.setdefault(key.casefold(), spec)

    def find(self, name: str | None) -> ModelSpec | None:
        """The model `name` means (None or "default": the default model); None if none."""
        if name is None or name in ("", DEFAULT_NAME):
            return self.default
        for key in (name, name.removesuffix(_TAG)):
            if key in self._exact:
                return self._exact[key]
        for key in (name, name.removesuffix(_TAG)):
            if key.casefold() in self._folded:
                return self._folded[key.casefold()]
        return None

    @property
    def has_one_model(self) -> bool:
        """Whether the default is the only model on disk: the embedded default that the
        library lists before its first download is an offer, not a second model."""
        return sum(s.is_default or s.entry.is_downloaded for s in self.specs) == 1

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]


def build_index(models_dir: Path, configured: list[Configured], default_path: Path,
                default_name: str) -> ModelIndex:
    """Scan models_dir (headers only) and merge the configured models and the default.

    The default model keeps the name the server gives it (--alias, else its file name); its
    library name becomes an alias. The default is listed first, then the rest by name.
    """
    entries = scan(models_dir)
    by_path = {e.path.resolve(): e for e in entries}
    specs: dict[str, ModelSpec] = {}
    default_entry = by_path.pop(default_path.resolve(), None)
    if default_entry is None:
        default_entry = describe(default_path, default_name) if default_path.exists() else \
            ModelEntry(default_name, default_path, "gguf", 0, "unknown", "", 0, 0,
                       is_downloaded=False)
    # The embedded default's offer (listed before its first download) is the served model
    # itself when --model names a copy of that file elsewhere: not a second model.
    by_path = {path: e for path, e in by_path.items()
               if e.is_downloaded or e.path.name != default_path.name}
    default_aliases = tuple({default_entry.name} - {default_name})
    specs[default_name] = ModelSpec(default_name, replace(default_entry, name=default_name),
                                    default_aliases, is_default=True)
    for entry in by_path.values():
        specs.setdefault(entry.name, ModelSpec(entry.name, entry))
    for item in configured:
        if item.path is not None:
            base = specs.get(item.name)
            if base is None or base.path.resolve() != item.path.resolve():
                if not item.path.exists():
                    log.warning("[models.%s]: %s does not exist; not listed", item.name,
                                item.path)
                    continue
                base = ModelSpec(item.name, describe(item.path, item.name))
            specs[item.name] = replace(base, aliases=(*base.aliases, *item.aliases))
        elif item.name in specs:
            base = specs[item.name]
            specs[item.name] = replace(base, aliases=(*base.aliases, *item.aliases))
        else:
            found = ModelIndex(specs.values()).find(item.name)
            if found is None:
                log.warning("[models.%s] has no path and no model of that name is in %s; "
                            "its aliases are ignored", item.name, models_dir)
                continue
            specs[found.name] = replace(found, aliases=(*found.aliases, *item.aliases))
    ordered = [specs.pop(default_name), *sorted(specs.values(), key=lambda s: s.name.lower())]
    return ModelIndex(ordered)
