"""A fast reader for GGUF v2/v3 files: header, metadata and tensor infos, with the tensor data
left in the memory-mapped file until a caller asks for a view.

The `gguf` package's GGUFReader builds a numpy view for every string of every array (a
49k-token vocabulary and its merges: a million views, seconds); here a numeric array is one
`numpy.frombuffer` and a string array is skipped over by its length prefixes and decoded only
when a caller reads it (the engine needs the config keys and tensor infos, the tokenizer needs
the vocabulary). numpy + struct only: the host side imports this too, without torch.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses tensors with more

# GGUFValueType ids (gguf/constants.py; fixed by the file format).
_STRING, _ARRAY = 8, 9
_SCALAR_DTYPES: dict[int, np.dtype] = {
    type_id: np.dtype(code)
    for type_id, code in {
        0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
        10: "<u8", 11: "<i8", 12: "<f8",
    }.items()
}
_SCALAR_STRUCTS = {
    type_id: struct.Struct("<" + code)
    for type_id, code in {
        0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
    }.items()
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEADER = struct.Struct("<IQ")  # item type, item count

# Tensor types numpy can view in their own dtype; every other type is viewed as its bytes.
_NATIVE_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader can parse; the message is one line, without the path."""


class GGUFTruncatedError(GGUFFormatError):
    """The tensor infos point past the end of the file."""

    def __init__(self, have_bytes: int, need_bytes: int) -> None:
        super().__init__(f"truncated ({have_bytes} of {need_bytes} bytes)")
        self.have_bytes, self.need_bytes = have_bytes, need_bytes


class GGUFUnknownTypeError(GGUFFormatError):
    """A tensor uses a GGML type id this version of the `gguf` package does not know."""

    def __init__(self, tensor_name: str, type_id: int) -> None:
        super().__init__(f"tensor {tensor_name} uses unknown type id {type_id}")
        self.tensor_name, self.type_id = tensor_name, type_id


class _LazyStrings:
    """A string array found in the header, decoded on first read."""

    __slots__ = ("buffer", "count", "offset")

    def __init__(self, buffer: mmap.mmap, offset: int, count: int) -> None:
        self.buffer, self.offset, self.count = buffer, offset, count

    def decode(self) -> list[str]:
        unpack, buffer, offset = _U64.unpack_from, self.buffer, self.offset
        out = []
        append = out.append
        for _ in range(self.count):
            (length,) = unpack(buffer, offset)
            offset += 8
            append(str(buffer[offset : offset + length], "utf-8"))
            offset += length
        return out


class _LazyNumbers:
    """A numeric array found in the header, converted to Python values on first read."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    @property
    def count(self) -> int:
        return len(self.values)

    def decode(self) -> list[Any]:
        return self.values.tolist()


class GGUFMetadata(Mapping[str, Any]):
    """The key/value metadata in file order, as plain Python values: int, float, bool, str, or
    a list of them (nested arrays stay nested). Arrays are decoded on first read and kept, so
    filter on the keys before reading values: `.items()` decodes the vocabulary too."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self._raw = raw

    def __getitem__(self, key: str) -> Any:
        value = self._raw[key]
        if isinstance(value, (_LazyStrings, _LazyNumbers)):
            try:
                value = value.decode()
            except UnicodeDecodeError as e:
                raise GGUFFormatError(
                    f"metadata {key} holds a string that is not UTF-8 ({e})") from None
            self._raw[key] = value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def array_len(self, key: str) -> int | None:
        """How many items the array `key` holds, without decoding it; None if absent or not an
        array."""
        value = self._raw.get(key)
        if isinstance(value, (_LazyStrings, _LazyNumbers)):
            return value.count
        return len(value) if isinstance(value, list) else None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header; `data` views its bytes in the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: ne[0], the row length, first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    _buffer: mmap.mmap = field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        """A read-only view of the stored data in numpy order (last dimension = row): F32, F16,
        F64 and I8..I64 in their own dtype, every other type as uint8 blocks
        [..., rows, row_bytes]. The same array the `gguf` package's reader gives."""
        dims = tuple(reversed(self.shape))
        dtype = _NATIVE_TENSOR_DTYPES.get(self.tensor_type)
        if dtype is None:
            block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
            dims = dims or (1,)  # a 0-d tensor is one row of one value
            dims = (*dims[:-1], dims[-1] // block_size * type_size)
            dtype, count = np.dtype(np.uint8), self.n_bytes
        else:
            count = self.n_elements
        return np.frombuffer(self._buffer, dtype, count, self.data_offset).reshape(dims)


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF file: its metadata, its tensor infos, and the map they view."""

    path: str
    version: int
    alignment: int
    data_offset: int  # where the tensor data starts
    metadata: GGUFMetadata
    tensors: list[TensorInfo]
    _buffer: mmap.mmap = field(repr=False, compare=False)  # kept open while the file is used


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor infos; tensor data stays in the map.

    Raises GGUFFormatError (one-line message) for anything that is not a well-formed
    little-endian GGUF v2/v3 whose tensors fit in the file, and OSError if it cannot be opened.
    """
    with open(path, "rb") as f:
        size_bytes = os.fstat(f.fileno()).st_size
        if size_bytes < 24:  # magic, version, tensor count, kv count
            raise GGUFFormatError(f"the header is cut short ({size_bytes} bytes)")
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _Parser(buffer, os.fspath(path)).parse()
    except (struct.error, OverflowError):  # a length or count points past the end
        raise GGUFFormatError("the header runs past the end of the file") from None
    except UnicodeDecodeError as e:
        raise GGUFFormatError(f"a name or string in the header is not UTF-8 ({e})") from None


class _Parser:
    def __init__(self, buffer: mmap.mmap, path: str) -> None:
        self.buffer, self.path = buffer, path
        self.size_bytes = len(buffer)

    def parse(self) -> GGUFFile:
        buffer = self.buffer
        if buffer[:4] != _MAGIC:
            raise GGUFFormatError(f"it starts with {buffer[:4]!r}, not {_MAGIC!r}")
        (version,) = _U32.unpack_from(buffer, 4)
        if version & 0xFFFF == 0 and version != 0:
            # A byte-swapped version number: written for a big-endian machine.
            raise GGUFFormatError("it is a big-endian GGUF; Strata reads little-endian files")
        if version not in _SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (only 2 and 3)")
        tensor_count, kv_count = struct.unpack_from("<QQ", buffer, 8)
        offset = 24
        raw: dict[str, Any] = {}
        for _ in range(kv_count):
            key, offset = self._string(offset)
            (value_type,) = _U32.unpack_from(buffer, offset)
            value, offset = self._value(value_type, offset + 4, key)
            if key in raw:
                raise GGUFFormatError(f"metadata key {key} appears twice")
            raw[key] = value
        infos = []
        for _ in range(tensor_count):
            info, offset = self._tensor_info(offset)
            infos.append(info)
        alignment = self._alignment(raw)
        data_offset = -(-offset // alignment) * alignment
        return GGUFFile(
            path=self.path,
            version=version,
            alignment=alignment,
            data_offset=data_offset,
            metadata=GGUFMetadata(raw),
            tensors=self._tensors(infos, data_offset),
            _buffer=buffer,
        )

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = _U64.unpack_from(self.buffer, offset)
        end = offset + 8 + length
        if end > self.size_bytes:
            raise struct.error("string past the end")
        return str(self.buffer[offset + 8 : end], "utf-8"), end

    def _value(self, value_type: int, offset: int, key: str) -> tuple[Any, int]:
        scalar = _SCALAR_STRUCTS.get(value_type)
        if scalar is not None:
            return scalar.unpack_from(self.buffer, offset)[0], offset + scalar.size
        if value_type == _STRING:
            return self._string(offset)
        if value_type != _ARRAY:
            raise GGUFFormatError(f"metadata {key} has unknown value type {value_type}")
        item_type, count = _ARRAY_HEADER.unpack_from(self.buffer, offset)
        offset += _ARRAY_HEADER.size
        # Every item takes at least one byte: a corrupt count fails here, not in a long loop.
        if count > self.size_bytes - offset:
            raise struct.error("array past the end")
        dtype = _SCALAR_DTYPES.get(item_type)
        if dtype is not None:
            end = offset + count * dtype.itemsize
            if end > self.size_bytes:
                raise struct.error("array past the end")
            return _LazyNumbers(np.frombuffer(self.buffer, dtype, count, offset)), end
        if item_type == _STRING:
            return _LazyStrings(self.buffer, offset, count), self._skip_strings(offset, count)
        if item_type != _ARRAY:
            raise GGUFFormatError(f"metadata {key} has an array of unknown type {item_type}")
        items = []
        for _ in range(count):  # each inner array has its own item type and count
            item, offset = self._value(_ARRAY, offset, key)
            items.append(item.decode() if isinstance(item, (_LazyStrings, _LazyNumbers)) else item)
        return items, offset

    def _skip_strings(self, offset: int, count: int) -> int:
        unpack, buffer = _U64.unpack_from, self.buffer
        for _ in range(count):
            offset += 8 + unpack(buffer, offset)[0]
        if offset > self.size_bytes:
            raise struct.error("string array past the end")
        return offset

    def _tensor_info(self, offset: int) -> tuple[tuple[str, tuple[int, ...], int, int], int]:
        name, offset = self._string(offset)
        (n_dims,) = _U32.unpack_from(self.buffer, offset)
        if n_dims > _MAX_DIMS:
            raise GGUFFormatError(f"tensor {name} has {n_dims} dimensions (at most {_MAX_DIMS})")
        shape = struct.unpack_from(f"<{n_dims}Q", self.buffer, offset + 4)
        offset += 4 + 8 * n_dims
        type_id, data_offset = struct.unpack_from("<IQ", self.buffer, offset)
        return (name, shape, type_id, data_offset), offset + 12

    def _alignment(self, raw: dict[str, Any]) -> int:
        alignment = raw.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or (
            alignment & (alignment - 1)
        ):
            raise GGUFFormatError(f"general.alignment {alignment!r} is not a power of two")
        return alignment

    def _tensors(self, infos: list, data_start: int) -> list[TensorInfo]:
        tensors, names, end_bytes = [], set(), 0
        for name, shape, type_id, relative_offset in infos:
            if name in names:
                raise GGUFFormatError(f"tensor {name} appears twice")
            names.add(name)
            try:
                tensor_type = GGMLQuantizationType(type_id)
                block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            except (ValueError, KeyError):
                raise GGUFUnknownTypeError(name, type_id) from None
            row_values = shape[0] if shape else 1
            if row_values % block_size:
                raise GGUFFormatError(
                    f"tensor {name} has rows of {row_values} values, not whole "
                    f"{tensor_type.name} blocks of {block_size}"
                )
            n_elements = 1
            for dim in shape:
                n_elements *= dim
            n_bytes = n_elements * type_size // block_size
            data_offset = data_start + relative_offset
            end_bytes = max(end_bytes, data_offset + n_bytes)
            tensors.append(TensorInfo(name, tensor_type, tuple(shape), n_elements, n_bytes,
                                      data_offset, self.buffer))
        if end_bytes > self.size_bytes:
            raise GGUFTruncatedError(self.size_bytes, end_bytes)
        return tensors
