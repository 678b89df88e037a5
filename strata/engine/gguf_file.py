"""Open a GGUF file with Strata's reader (gguf_reader.py) and turn every way it can fail into a
one-line ModelFormatError (missing, not GGUF, truncated, corrupt).

Shared by the host (tokenizer and chat template, strata/engine/text) and the engine (config
and tensors, strata/engine/core/loader), so it imports neither torch nor anything of theirs;
in one process (`strata generate`) both sides get the same cached file, parsed once.
"""

from __future__ import annotations

import functools
import os
import stat
from pathlib import Path

from strata.engine.core.model_config import ModelFormatError
from strata.engine.gguf_reader import (
    GGUFFile,
    GGUFFormatError,
    GGUFTruncatedError,
    GGUFUnknownTypeError,
    read_gguf,
)

_GGUF_MAGIC_BYTES = b"GGUF"


def missing_model_error(path: Path) -> ModelFormatError:
    """The error for a model path that does not exist (shared by every format)."""
    return ModelFormatError(
        f"model file {path} not found: pass --model with a .gguf file or a Hugging Face "
        "directory, or run `strata pull`"
    )


# What a path that is neither a regular file nor a directory is, for the error that names it.
_FILE_KINDS = ((stat.S_ISFIFO, "named pipe (FIFO)"), (stat.S_ISCHR, "character device"),
               (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def model_path_problem(path: str | os.PathLike[str], *, missing_ok: bool = False
                       ) -> str | None:
    """Why `path` cannot be a model, from its type alone (os.stat, through symlinks, opens
    nothing): missing (unless missing_ok: the caller reports that its own way), or neither a
    regular file nor a directory. Opening a FIFO blocks until a writer comes and a device may
    never end, so this runs before any open (issue 51). None when it may be one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None if missing_ok else str(missing_model_error(Path(path)))
    except OSError as exc:
        return f"model {path} cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "special file")
    return (f"model {path} is a {kind}, not a regular file: pass a .gguf file or a Hugging "
            "Face directory")


def check_model_path(path: str | os.PathLike[str]) -> None:
    """ModelFormatError (one line) when `path` cannot be a model (model_path_problem)."""
    problem = model_path_problem(path)
    if problem is not None:
        raise ModelFormatError(problem)


def is_regular_file(path: str | os.PathLike[str]) -> bool:
    """True for a regular file (through symlinks); False for anything an open could block on."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def is_gguf_file(path: Path) -> bool:
    """True when `path` is a regular file that starts with the GGUF magic."""
    if not is_regular_file(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC_BYTES
    except OSError:
        return False


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file (memory-mapped; no tensor data is read here).

    The parsed file is cached for the last file opened, keyed by size and mtime, because the
    config, the tensors and the tokenizer are read one after the other from the same file.
    """
    p = Path(path)
    check_model_path(p)
    st = p.stat()
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{p} is not a file: pass a .gguf file or a Hugging Face directory")
    return _open_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size_bytes: int, _mtime_ns: int) -> GGUFFile:
    with open(path, "rb") as f:
        head = f.read(4)
    if head != _GGUF_MAGIC_BYTES:
        raise ModelFormatError(
            f"{path} is not a GGUF file (it starts with {head!r}, not b'GGUF'): pass a .gguf "
            "file or a Hugging Face directory"
        )
    try:
        return read_gguf(path)
    except GGUFTruncatedError as e:
        raise ModelFormatError(
            f"{path} is truncated ({e.have_bytes} of {e.need_bytes} bytes): download it again"
        ) from None
    except GGUFUnknownTypeError as e:
        raise ModelFormatError(
            f"tensor {e.tensor_name} uses unknown quant type id {e.type_id}, which Strata cannot "
            "dequantize; use a Q4_K_M, Q8_0 or F16 file"
        ) from None
    except GGUFFormatError as e:
        raise ModelFormatError(
            f"{path} is truncated or corrupt ({size_bytes} bytes; its header cannot be read: "
            f"{e}): download it again"
        ) from None
    except OSError as e:
        raise ModelFormatError(f"{path} cannot be read ({e.strerror or e})") from None
