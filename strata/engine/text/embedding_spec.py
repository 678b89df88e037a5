"""What a model's embeddings look like, read from its metadata on the host: width and pooling.

Pooling follows the model's own declaration: GGUF `{arch}.pooling_type` (llama.cpp's enum:
1 mean, 3 last) or a sentence-transformers `1_Pooling/config.json`. A model that declares none
(every chat model) gets last-token pooling: in a causal model only the last position has
attended to the whole input, and it is what decoder-only embedders (Qwen3-Embedding,
e5-mistral, gte-Qwen) are trained with, what vLLM uses for decoder models and what llama.cpp
forces for Qwen3. (llama.cpp's own default for such a file is no pooling, per-token vectors,
which its /v1/embeddings refuses; Ollama falls back to the last token's vector.)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from strata.engine.core.model_config import ModelFormatError
from strata.engine.gguf_file import is_gguf_file, open_gguf

DEFAULT_POOLING = "last"
_GGUF_POOLING = {1: "mean", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_MEAN, _LAST
_ST_POOLING = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class EmbeddingSpec:
    dimensions: int  # hidden_size: the length of every vector (0: unknown)
    pooling: str  # protocol.POOLINGS


@functools.lru_cache(maxsize=4)
def embedding_spec(source: str) -> EmbeddingSpec:
    """The spec of the model at `source` (a .gguf file or a Hugging Face directory)."""
    path = Path(source)
    try:
        if is_gguf_file(path):
            return _gguf_spec(path)
        if path.is_dir():
            return _hf_spec(path)
    except (ModelFormatError, OSError, ValueError):
        pass  # unreadable metadata: the engine's vectors still say their width
    return EmbeddingSpec(0, DEFAULT_POOLING)


def _gguf_spec(path: Path) -> EmbeddingSpec:
    reader = open_gguf(path)
    meta = reader.metadata
    arch = str(meta.get("general.architecture", ""))
    pooling = _GGUF_POOLING.get(meta.get(f"{arch}.pooling_type"), DEFAULT_POOLING)
    return EmbeddingSpec(int(meta.get(f"{arch}.embedding_length", 0) or 0), pooling)


def _hf_spec(directory: Path) -> EmbeddingSpec:
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    text_config = config.get("text_config") or config
    pooling = DEFAULT_POOLING
    st_file = directory / "1_Pooling" / "config.json"
    if st_file.is_file():
        st_config = json.loads(st_file.read_text(encoding="utf-8"))
        pooling = next((mode for key, mode in _ST_POOLING.items() if st_config.get(key)),
                       DEFAULT_POOLING)
    return EmbeddingSpec(int(text_config.get("hidden_size", 0) or 0), pooling)
