"""Open a GGUF file with the `gguf` package's reader and turn every way it can fail into a
one-line ModelFormatError (missing, not GGUF, truncated, corrupt).

Shared by the host (tokenizer and chat template, strata/engine/text) and the engine (config
and tensors, strata/engine/core/loader), so it imports neither torch nor anything of theirs;
in one process (`strata generate`) both sides get the same cached reader, parsed once.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader

from strata.engine.core.model_config import ModelFormatError

_GGUF_MAGIC_BYTES = GGUF_MAGIC.to_bytes(4, "little")  # b"GGUF"


def missing_model_error(path: Path) -> ModelFormatError:
    """The error for a model path that does not exist (shared by every format)."""
    return ModelFormatError(
        f"model file {path} not found: pass --model with a .gguf file or a Hugging Face "
        "directory, or run `strata pull`"
    )


def is_gguf_file(path: Path) -> bool:
    """True when `path` is a regular file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC_BYTES
    except OSError:
        return False


class _TruncatedError(Exception):
    def __init__(self, have_bytes: int, need_bytes: int) -> None:
        super().__init__(have_bytes, need_bytes)
        self.have_bytes, self.need_bytes = have_bytes, need_bytes


class _UnknownTypeError(Exception):
    def __init__(self, tensor_name: str, type_id: int) -> None:
        super().__init__(tensor_name, type_id)
        self.tensor_name, self.type_id = tensor_name, type_id


class _CheckedReader(GGUFReader):
    """GGUFReader that checks the tensor data fits in the file before it slices the memmap.

    Without this, a short file fails deep inside numpy with a reshape error that says nothing
    about truncation. `_build_tensors` is the reader's hook between parsing the tensor infos and
    viewing the data, so the check lives there.
    """

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        end_bytes = start_offs
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            type_id = int(raw_dtype[0])
            try:
                block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
            except (ValueError, KeyError):
                raise _UnknownTypeError(bytes(name_data).decode("utf-8", "replace"),
                                        type_id) from None
            n_elements = int(np.prod(dims.astype(np.uint64), dtype=np.uint64))
            tensor_end = start_offs + int(offset_tensor[0]) + n_elements * type_size // block_size
            end_bytes = max(end_bytes, tensor_end)
        if end_bytes > len(self.data):
            raise _TruncatedError(len(self.data), end_bytes)
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Open and validate a GGUF file (memory-mapped; nothing is dequantized here).

    The reader is cached for the last file opened, keyed by size and mtime, because the config
    and the tensors are loaded one after the other and parsing a 150k-token vocabulary twice
    costs seconds.
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise missing_model_error(p) from None
    if not p.is_file():
        raise ModelFormatError(f"{p} is not a file: pass a .gguf file or a Hugging Face directory")
    return _open_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size_bytes: int, _mtime_ns: int) -> GGUFReader:
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _GGUF_MAGIC_BYTES:
        raise ModelFormatError(
            f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF'): pass a .gguf "
            "file or a Hugging Face directory"
        )
    try:
        return _CheckedReader(path, "r")
    except _TruncatedError as e:
        raise ModelFormatError(
            f"{path} is truncated ({e.have_bytes} of {e.need_bytes} bytes): download it again"
        ) from None
    except _UnknownTypeError as e:
        raise ModelFormatError(
            f"tensor {e.tensor_name} uses unknown quant type id {e.type_id}, which Strata cannot "
            "dequantize; use a Q4_K_M, Q8_0 or F16 file"
        ) from None
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError) as e:
        # A header cut short makes the reader index past the end of the memmap.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(
            f"{path} is truncated or corrupt ({size_bytes} bytes; its header cannot be read: "
            f"{reason}): download it again"
        ) from None


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (str, int, float, bool or list), or default."""
    field = reader.get_field(key)
    if field is None:
        return default
    return field.contents()
