"""The model lists of a ModelPool: /v1/models, /v1/models/{id}, Ollama's /api/tags and /api/ps.

Every library model is listed with its size, format, quantization, context and state
(loaded | sleeping | unloaded | available, and the pool's finer state); nothing is woken or
loaded to answer. Server paths never leave: rows carry names, not paths.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from pathlib import Path
from typing import Any

from strata.engine.api.errors import ApiError
from strata.engine.service.levels import State, resident_bytes
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.status_schema import ModelRow

_TAG = ":latest"
_FOREVER = dt.datetime(2318, 1, 1, tzinfo=dt.UTC)  # Ollama's "never expires"


def model_word(row: ModelRow) -> str:
    """/v1/models' status: loaded | sleeping | unloaded, or available (never started)."""
    if row["state"] == "available":
        return "available"
    return State(row["state"]).model_status


def openai_model(pool: ModelPool, row: ModelRow, created_s: int) -> dict[str, Any]:
    """One /v1/models entry: OpenAI's fields, then Strata's."""
    member = pool.member(row["name"])
    context = member.context_tokens if member is not None else row["context_tokens"]
    return {"id": row["name"], "object": "model", "created": created_s, "owned_by": "strata",
            "status": model_word(row), "state": row["state"], "context_tokens": context,
            "aliases": row["aliases"], "is_default": row["is_default"],
            "format": row["format"], "size_bytes": row["size_bytes"],
            "quantization": row["quantization"], "architecture": row["architecture"],
            "parameter_count": row["parameter_count"], "vram_bytes": row["vram_bytes"],
            "load_bytes": row["load_bytes"]}


def openai_models(pool: ModelPool, created_s: int) -> dict[str, Any]:
    return {"object": "list", "data": [openai_model(pool, row, created_s)
                                       for row in pool.models()]}


def openai_model_by_name(pool: ModelPool, name: str, created_s: int) -> dict[str, Any]:
    """GET /v1/models/{name}: by any name the model answers to; 404 otherwise."""
    spec = pool.find(name)
    row = next((r for r in pool.models() if spec is not None and r["name"] == spec.name), None)
    if row is None:
        raise ApiError(404, f"model {name!r} not found; GET /v1/models lists this server's "
                       "models", "model_not_found", param="model")
    return openai_model(pool, row, created_s)


def ollama_name(name: str) -> str:
    """Ollama's name: tagged ':latest' unless it has a tag of its own."""
    return name if ":" in name else f"{name}{_TAG}"


def _human_parameters(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def _ollama_entry(row: ModelRow) -> dict[str, Any]:
    path = Path(row["path"])
    try:
        modified = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC)
    except OSError:  # the embedded default before its first fetch
        modified = dt.datetime.fromtimestamp(0, dt.UTC)
    name = ollama_name(row["name"])
    return {"name": name, "model": name,
            "modified_at": modified.isoformat().replace("+00:00", "Z"),
            "size": row["size_bytes"],
            "digest": hashlib.sha256(f"{path}:{row['size_bytes']}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": row["format"],
                        "family": row["architecture"], "families": [row["architecture"]],
                        "parameter_size": _human_parameters(row["parameter_count"]),
                        "quantization_level": row["quantization"]},
            "state": row["state"]}


def ollama_tags(pool: ModelPool) -> dict[str, Any]:
    return {"models": [_ollama_entry(row) for row in pool.models()]}


def ollama_ps(pool: ModelPool) -> dict[str, Any]:
    """The models that hold memory (loaded or sleeping), with their VRAM and expiry."""
    models = []
    for row in pool.models():
        member = pool.member(row["name"])
        if member is None or model_word(row) == "unloaded":
            continue
        status = member.status()
        countdown_s = (status.get("idle") or {}).get("unload")
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=countdown_s)
                   if countdown_s is not None else _FOREVER)
        entry = _ollama_entry(row)
        entry.update(expires_at=expires.isoformat().replace("+00:00", "Z"),
                     size_vram=resident_bytes(status.get("vram") or {}),
                     context_length=member.context_tokens)
        models.append(entry)
    return {"models": models}
