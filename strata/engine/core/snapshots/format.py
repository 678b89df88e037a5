"""The snapshot file: a checked header, then the token ids and one region per layer's k and v.

    magic "STRATAKV" | u32 version | u32 header_bytes | header JSON | u32 crc32(header JSON)
    payload: token ids (int32 LE) | k0 | v0 | k1 | v1 | ...   (raw rows, [n, kv_heads, head_dim])

The header holds the model fingerprint, the layout, the token count, the sha256 of the token
ids, created/expires (wall clock) and each region's offset, size and crc32. Named files are
written to a private temporary file (0600, O_EXCL, unpredictable name) in the same directory,
flushed, fsync'd and renamed, so a reader sees either the old file or the complete new one.
Reading verifies all of it and raises one `SnapshotInvalid(reason)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from strata.engine.core.snapshots.errors import SnapshotInvalid, SnapshotWriteError
from strata.engine.core.snapshots.kv_state import KVLayout, KVSnapshot, check_metadata, region_names
from strata.engine.core.snapshots.safe_files import create_temp, open_regular

MAGIC = b"STRATAKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")  # magic, version, header_bytes
_CRC = struct.Struct("<I")
_MAX_HEADER_BYTES = 1 << 20  # a header is a few hundred bytes per layer; more means garbage


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # A uint8 view of the host tensor: no copy, and works for bfloat16, which numpy lacks.
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _token_bytes(token_ids: tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def encode(snapshot: KVSnapshot, slot: int | None = None) -> tuple[bytes, list[memoryview]]:
    """The file prefix + header, and the payload pieces in file order."""
    tokens = _token_bytes(snapshot.token_ids)
    pieces = [memoryview(tokens)] + [_tensor_bytes(t) for t in snapshot.regions]
    names = ["tokens", *region_names(snapshot.layout.num_layers)]
    regions, offset = [], 0
    for name, piece in zip(names, pieces, strict=True):
        regions.append({"name": name, "offset": offset, "nbytes": piece.nbytes,
                        "crc32": zlib.crc32(piece)})
        offset += piece.nbytes
    header = {
        "fingerprint": snapshot.fingerprint,
        "layout": snapshot.layout.as_dict(),
        "num_tokens": snapshot.num_tokens,
        "tokens_sha256": hashlib.sha256(tokens).hexdigest(),
        "created_s": snapshot.created_s,
        "expires_s": snapshot.expires_s,
        "slot": slot,
        "payload_bytes": offset,
        "regions": regions,
    }
    header_json = json.dumps(header, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_json))
    return prefix + header_json + _CRC.pack(zlib.crc32(header_json)), pieces


def write_to(f: BinaryIO, snapshot: KVSnapshot, slot: int | None = None) -> int:
    """Write the whole snapshot into an open binary file, flush and fsync; returns bytes written."""
    head, pieces = encode(snapshot, slot)
    f.write(head)
    f.writelines(pieces)
    f.flush()
    # fsync surfaces a late ENOSPC/EIO now, while the caller still holds the KV.
    os.fsync(f.fileno())
    return len(head) + sum(p.nbytes for p in pieces)


def write_file(path: Path, snapshot: KVSnapshot, slot: int | None = None) -> int:
    """Write `path` atomically (temp name in the same directory, fsync, rename); bytes written.

    The directory must exist and be private (safe_files.prepare_dir); the temp file is
    created 0600 with O_EXCL|O_NOFOLLOW under an unpredictable name, so the file is 0600 too.
    Raises SnapshotWriteError (one line, with the OS reason) and leaves no temp file behind.
    """
    path = Path(path)
    temp: Path | None = None
    try:
        f, temp = create_temp(path.parent, path.name)
        with f:
            written = write_to(f, snapshot, slot)
        os.replace(temp, path)
        temp = None
        _fsync_dir(path.parent)
        return written
    except OSError as exc:
        if temp is not None:
            _remove_quietly(temp)
        raise SnapshotWriteError.from_os_error(f"could not write KV snapshot {path.name}",
                                               exc) from exc


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # the directory itself is the problem (gone, not a directory); nothing to clean


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; not possible on Windows, where opening a directory fails.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(f: BinaryIO, size_bytes: int) -> tuple[dict[str, Any], int]:
    """The verified header of an open snapshot file and where its payload starts."""
    f.seek(0)
    raw = f.read(_PREFIX.size)
    if len(raw) < _PREFIX.size:
        raise SnapshotInvalid("truncated", f"the file has {size_bytes} bytes, not even a header")
    magic, version, header_bytes = _PREFIX.unpack(raw)
    if magic != MAGIC:
        raise SnapshotInvalid("corrupt", "the file is not a Strata KV snapshot (bad magic)")
    if version != FORMAT_VERSION:
        raise SnapshotInvalid(
            "other_version", f"format version {version}, this Strata reads {FORMAT_VERSION}"
        )
    if header_bytes > _MAX_HEADER_BYTES:
        raise SnapshotInvalid("corrupt", f"header length {header_bytes} is implausible")
    rest = f.read(header_bytes + _CRC.size)
    if len(rest) < header_bytes + _CRC.size:
        raise SnapshotInvalid("truncated", "the file ends inside its header")
    header_json, (crc,) = rest[:header_bytes], _CRC.unpack(rest[header_bytes:])
    if zlib.crc32(header_json) != crc:
        raise SnapshotInvalid("corrupt", "the header checksum does not match")
    try:
        header = json.loads(header_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotInvalid("corrupt", f"the header is not JSON ({exc})") from exc
    return header, _PREFIX.size + header_bytes + _CRC.size


def read_from(
    f: BinaryIO, fingerprint: str, layout: KVLayout, now_s: float, size_bytes: int | None = None
) -> KVSnapshot:
    """Read and verify a snapshot from an open file; raises SnapshotInvalid(reason)."""
    if size_bytes is None:
        size_bytes = os.fstat(f.fileno()).st_size
    header, payload_start = read_header(f, size_bytes)
    try:
        check_metadata(header, fingerprint, layout)
        expires_s = header["expires_s"]
        if expires_s is not None and now_s > expires_s:
            raise SnapshotInvalid("expired", f"it expired {now_s - expires_s:.0f} s ago")
        num_tokens, payload_bytes = int(header["num_tokens"]), int(header["payload_bytes"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotInvalid("corrupt", f"the header lacks a field ({exc})") from exc
    if size_bytes < payload_start + payload_bytes:
        raise SnapshotInvalid(
            "truncated", f"{size_bytes} bytes on disk, the header promises {payload_start + payload_bytes}"
        )
    if size_bytes > payload_start + payload_bytes:
        raise SnapshotInvalid("corrupt", "the file has bytes past its payload")
    payload = bytearray(payload_bytes)
    f.seek(payload_start)
    if f.readinto(payload) != payload_bytes:
        raise SnapshotInvalid("truncated", "the file ended while reading the payload")
    try:
        return _decode_payload(header, payload, layout, num_tokens)
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        raise SnapshotInvalid("corrupt", f"the region table is malformed ({exc})") from exc


def _decode_payload(
    header: dict[str, Any], payload: bytearray, layout: KVLayout, num_tokens: int
) -> KVSnapshot:
    view = memoryview(payload)
    expected_names = ["tokens", *region_names(layout.num_layers)]
    region_bytes = num_tokens * layout.region_bytes_per_token
    if [r.get("name") for r in header["regions"]] != expected_names:
        raise SnapshotInvalid("corrupt", "the region table does not match the layout")
    tensors: list[torch.Tensor] = []
    token_ids: tuple[int, ...] = ()
    for region in header["regions"]:
        offset, nbytes = int(region["offset"]), int(region["nbytes"])
        want = 4 * num_tokens if region["name"] == "tokens" else region_bytes
        if nbytes != want or offset + nbytes > len(payload):
            raise SnapshotInvalid("corrupt", f"region {region['name']} has the wrong size")
        piece = view[offset : offset + nbytes]
        if zlib.crc32(piece) != region["crc32"]:
            raise SnapshotInvalid("corrupt", f"region {region['name']} fails its checksum")
        if region["name"] == "tokens":
            if hashlib.sha256(piece).hexdigest() != header["tokens_sha256"]:
                raise SnapshotInvalid("corrupt", "the token ids do not match their hash")
            token_ids = struct.unpack(f"<{num_tokens}i", piece)
            continue
        shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=layout.torch_dtype))
        else:
            # A view over the payload buffer: no second copy of a large snapshot.
            flat = torch.frombuffer(payload, dtype=layout.torch_dtype, offset=offset,
                                    count=nbytes // layout.element_bytes)
            tensors.append(flat.view(shape))
    return KVSnapshot(
        layout=layout,
        fingerprint=header["fingerprint"],
        token_ids=tuple(token_ids),
        regions=tensors,
        created_s=float(header["created_s"]),
        expires_s=header["expires_s"],
    )


def read_file(path: Path, fingerprint: str, layout: KVLayout, now_s: float) -> KVSnapshot:
    """Open, read and verify a named snapshot file; raises SnapshotInvalid(reason).

    Only a regular file is read: a FIFO, device or symlink is refused without blocking."""
    path = Path(path)
    try:
        with open_regular(path) as f:
            return read_from(f, fingerprint, layout, now_s)
    except OSError as exc:
        raise SnapshotInvalid("missing", f"{path.name} cannot be read: {exc.strerror}") from exc


def peek_tokens(path: Path) -> tuple[int, ...] | None:
    """The token ids a snapshot file holds (its first payload region, checked against the
    header's hash), without reading the KV; None when they cannot be read. Slot choice uses
    them to match a persisted session before anything restores it."""
    try:
        with open_regular(Path(path)) as f:
            header, payload_start = read_header(f, os.fstat(f.fileno()).st_size)
            region = header["regions"][0]
            num_tokens = int(header["num_tokens"])
            if region.get("name") != "tokens" or int(region["nbytes"]) != 4 * num_tokens:
                return None
            f.seek(payload_start + int(region["offset"]))
            piece = f.read(4 * num_tokens)
    except (OSError, SnapshotInvalid, KeyError, IndexError, TypeError, ValueError):
        return None
    if len(piece) != 4 * num_tokens or hashlib.sha256(piece).hexdigest() != header.get(
            "tokens_sha256"):
        return None
    return struct.unpack(f"<{num_tokens}i", piece)


def peek_header(path: Path) -> dict[str, Any] | None:
    """The verified header of a file, or None when it is not a readable snapshot."""
    try:
        with open_regular(Path(path)) as f:
            return read_header(f, os.fstat(f.fileno()).st_size)[0]
    except (OSError, SnapshotInvalid):
        return None
