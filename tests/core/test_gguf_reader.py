"""Strata's GGUF reader against the `gguf` package's GGUFReader (the oracle): every metadata
value, every tensor info and every tensor's bytes, on random files with every value type, the
loader's tiny models and the real default model; and one clear line for broken files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from strata.engine.core.model_config import ModelFormatError
from strata.engine.gguf_file import _open_cached, open_gguf
from strata.engine.gguf_reader import GGUFFile, GGUFFormatError, read_gguf

_NUMERIC_TYPES = {
    VT.UINT8: (0, 2**8), VT.INT8: (-(2**7), 2**7), VT.UINT16: (0, 2**16),
    VT.INT16: (-(2**15), 2**15), VT.UINT32: (0, 2**32), VT.INT32: (-(2**31), 2**31),
    VT.UINT64: (0, 2**64), VT.INT64: (-(2**63), 2**63),
}
_TENSOR_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.I32]


def _flatten(value: Any) -> Any:
    """GGUFReader flattens nested arrays (its FIXME); Strata keeps them nested."""
    if not isinstance(value, list):
        return value
    out = []
    for item in value:
        out.extend(_flatten(item) if isinstance(item, list) else [item])
    return out


def assert_matches_oracle(path: Path) -> GGUFFile:
    """Every metadata value, tensor info and tensor's bytes equal GGUFReader's."""
    ours, oracle = read_gguf(path), gguf.GGUFReader(path)
    oracle_fields = {k: f for k, f in oracle.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(oracle_fields)
    for key, field in oracle_fields.items():
        value = ours.metadata[key]
        assert _flatten(value) == field.contents(), key
        if field.types[0] == VT.ARRAY:
            assert ours.metadata.array_len(key) == len(value) and isinstance(value, list)
        else:
            assert ours.metadata.array_len(key) is None
    assert ours.data_offset == oracle.data_offset and ours.alignment == oracle.alignment
    assert len(ours.tensors) == len(oracle.tensors)
    for mine, theirs in zip(ours.tensors, oracle.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes,
                mine.data_offset) == (theirs.name, theirs.tensor_type, tuple(theirs.shape.tolist()),
                                      theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        data = mine.data
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape, mine.name
        assert data.tobytes() == theirs.data.tobytes(), mine.name
        assert not data.flags.writeable
    return ours


def _random_value(rng: np.random.Generator, depth: int = 0) -> tuple[Any, VT, VT | None]:
    """A random (value, type, array item type) covering every GGUF value type."""
    kind = rng.integers(0, 8 if depth else 9)
    if kind == 0:
        vtype = list(_NUMERIC_TYPES)[rng.integers(len(_NUMERIC_TYPES))]
        low, high = _NUMERIC_TYPES[vtype]
        return int(rng.integers(low, high, dtype=np.int64 if low else np.uint64)), vtype, None
    if kind == 1:
        return float(np.float32(rng.standard_normal() * 1e3)), VT.FLOAT32, None
    if kind == 2:
        return float(rng.standard_normal() * 1e-12), VT.FLOAT64, None
    if kind == 3:
        return bool(rng.integers(2)), VT.BOOL, None
    if kind == 4:
        return _random_string(rng), VT.STRING, None
    if kind == 5:
        return [_random_string(rng) for _ in range(rng.integers(1, 50))], VT.ARRAY, VT.STRING
    if kind == 6:
        vtype = list(_NUMERIC_TYPES)[rng.integers(len(_NUMERIC_TYPES))]
        low, high = _NUMERIC_TYPES[vtype]
        values = rng.integers(low, high, size=rng.integers(1, 200),
                              dtype=np.int64 if low else np.uint64)
        return [int(v) for v in values], VT.ARRAY, vtype
    if kind == 7:
        item_type = [VT.FLOAT32, VT.FLOAT64, VT.BOOL][rng.integers(3)]
        values = rng.standard_normal(rng.integers(1, 100))
        if item_type == VT.FLOAT32:
            return [float(v) for v in values.astype(np.float32)], VT.ARRAY, item_type
        if item_type == VT.BOOL:
            return [bool(v > 0) for v in values], VT.ARRAY, item_type
        return [float(v) for v in values], VT.ARRAY, item_type
    # Nested: the writer gives each inner array the type of its first item (str, int32, float32).
    maker = [lambda: _random_string(rng), lambda: int(rng.integers(-1000, 1000)),
             lambda: float(np.float32(rng.standard_normal()))][rng.integers(3)]
    inner = [[maker() for _ in range(rng.integers(1, 6))] for _ in range(rng.integers(1, 5))]
    return inner, VT.ARRAY, VT.ARRAY


def _random_string(rng: np.random.Generator) -> str:
    alphabet = "abcxyz ĠĊ▁<>|\n\t日本語😀é"
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), rng.integers(0, 12)))


def _random_tensor(rng: np.random.Generator, writer: gguf.GGUFWriter, name: str) -> None:
    qtype = _TENSOR_TYPES[rng.integers(len(_TENSOR_TYPES))]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    dims = [int(d) for d in rng.integers(1, 4, size=rng.integers(1, 4))]
    row = block_size * int(rng.integers(1, 3)) if block_size > 1 else int(rng.integers(1, 40))
    shape = (*dims[:-1], row)  # numpy order: the row last
    if qtype == QT.F32:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    elif qtype == QT.F16:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
    elif qtype == QT.I32:
        writer.add_tensor(name, rng.integers(-(2**31), 2**31, shape, dtype=np.int32))
    else:
        byte_shape = (*shape[:-1], row // block_size * type_size)
        writer.add_tensor(name, rng.integers(0, 256, byte_shape, dtype=np.uint8), raw_dtype=qtype)


def write_random_gguf(path: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    if seed % 2:
        writer.add_custom_alignment(int(2 ** rng.integers(3, 9)))
    for i in range(int(rng.integers(5, 40))):
        value, vtype, item_type = _random_value(rng)
        writer.add_key_value(f"test.key{i}", value, vtype, sub_type=item_type)
    for i in range(int(rng.integers(0, 12))):
        _random_tensor(rng, writer, f"blk.{i}.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("seed", range(12))
def test_random_files_match_the_oracle(tmp_path, seed):
    assert_matches_oracle(write_random_gguf(tmp_path / "r.gguf", seed))


def test_the_loaders_tiny_models_match_the_oracle(tmp_path):
    from tests.core.test_gguf_loader import hf_model
    from tests.helpers.gguf_writer import write_gguf_from_hf

    for variant, qtype in (("llama", "Q8_0"), ("qwen3_moe_mixed", "Q4_0")):
        path = write_gguf_from_hf(hf_model(variant), None, tmp_path / f"{variant}.gguf", qtype)
        assert_matches_oracle(path)


def test_the_default_model_matches_the_oracle(smollm2_gguf):
    ours = assert_matches_oracle(smollm2_gguf)
    assert ours.metadata.array_len("tokenizer.ggml.tokens") == 49152
    assert ours.metadata["general.architecture"] == "llama"


def _raw_gguf(path: Path, kv: list[tuple[str, int, bytes]], version: int = 3) -> Path:
    """A GGUF with hand-packed values (no tensors), for what GGUFWriter cannot write."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, 0, len(kv)))
    for key, vtype, payload in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload
    path.write_bytes(bytes(out))
    return path


def _array(item_type: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", item_type, len(items)) + b"".join(items)


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def test_empty_arrays_and_version_2(tmp_path):
    path = _raw_gguf(tmp_path / "e.gguf", [
        ("empty.strings", VT.ARRAY, _array(VT.STRING, [])),
        ("empty.u32", VT.ARRAY, _array(VT.UINT32, [])),
        ("empty.nested", VT.ARRAY, _array(VT.ARRAY, [])),
        ("nested.with_empty", VT.ARRAY, _array(VT.ARRAY, [
            _array(VT.STRING, [_string("a")]), _array(VT.STRING, []),
        ])),
        ("after", VT.STRING, _string("still read")),
    ], version=2)
    ours = assert_matches_oracle(path)
    assert ours.version == 2
    assert dict(ours.metadata) == {
        "empty.strings": [], "empty.u32": [], "empty.nested": [],
        "nested.with_empty": [["a"], []], "after": "still read",
    }
    assert ours.metadata.array_len("empty.strings") == 0


def test_strings_decode_lazily_and_once(tmp_path):
    path = _raw_gguf(tmp_path / "s.gguf", [
        ("tokens", VT.ARRAY, _array(VT.STRING, [_string(t) for t in ("a", "bc", "日本")])),
        ("bad", VT.ARRAY, _array(VT.STRING, [_string("ok"), struct.pack("<Q", 1) + b"\xff"])),
    ])
    ours = read_gguf(path)  # the bad string is not decoded while opening
    assert ours.metadata.array_len("tokens") == 3
    assert ours.metadata["tokens"] == ["a", "bc", "日本"]
    assert ours.metadata["tokens"] is ours.metadata["tokens"]
    with pytest.raises(GGUFFormatError, match="metadata bad holds a string that is not UTF-8"):
        ours.metadata["bad"]


def _one_line_error(path: Path) -> str:
    _open_cached.cache_clear()
    with pytest.raises(ModelFormatError) as info:
        open_gguf(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and "download it again" in message
    return message


def test_every_cut_of_the_header_is_one_clear_line(tmp_path):
    source = write_random_gguf(tmp_path / "r.gguf", seed=3)
    data = source.read_bytes()
    parsed = read_gguf(source)
    data_end = max(t.data_offset + t.n_bytes for t in parsed.tensors)
    cut = tmp_path / "cut.gguf"
    for size in [*range(4, 64), *range(64, parsed.data_offset + 1, 7), data_end - 1]:
        cut.write_bytes(data[:size])
        message = _one_line_error(cut)
        assert "truncated" in message, (size, message)


def test_corrupt_headers_give_one_clear_line_or_a_file(tmp_path):
    """Random byte flips in the header: the file either parses or fails with one line."""
    source = write_random_gguf(tmp_path / "r.gguf", seed=5)
    data = source.read_bytes()
    header_bytes = read_gguf(source).data_offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    num_refused = 0
    for _ in range(300):
        flipped = bytearray(data)
        for at in rng.integers(8, header_bytes, size=rng.integers(1, 4)):
            flipped[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(flipped))
        _open_cached.cache_clear()
        try:
            parsed = open_gguf(bad)
        except ModelFormatError as e:
            assert "\n" not in str(e) and ("download it again" in str(e) or "quant type" in str(e))
            num_refused += 1
            continue
        for key in parsed.metadata:
            try:
                parsed.metadata[key]
            except GGUFFormatError as e:  # a string array decoded lazily
                assert "\n" not in str(e)
    assert num_refused > 30


def test_wrong_version_and_big_endian_are_refused(tmp_path):
    path = _raw_gguf(tmp_path / "v1.gguf", [], version=1)
    assert "GGUF version 1 is not supported (only 2 and 3)" in _one_line_error(path)
    big = bytearray(_raw_gguf(tmp_path / "be.gguf", []).read_bytes())
    big[4:8] = struct.pack(">I", 3)
    (tmp_path / "be.gguf").write_bytes(bytes(big))
    assert "big-endian GGUF" in _one_line_error(tmp_path / "be.gguf")


def test_unknown_value_type_and_bad_alignment(tmp_path):
    path = _raw_gguf(tmp_path / "t.gguf", [("odd", 99, b"")])
    assert "metadata odd has unknown value type 99" in _one_line_error(path)
    path = _raw_gguf(tmp_path / "a.gguf", [("general.alignment", VT.UINT32, struct.pack("<I", 48))])
    assert "general.alignment 48 is not a power of two" in _one_line_error(path)
