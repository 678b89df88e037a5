"""Error codes of storage faults: the server's, never the client's, so the host answers 5xx.

One table for the snapshot writer and the engine process's error codes; torch-free, since
the host imports the engine process module.
"""

from __future__ import annotations

import errno

NO_SPACE_CODE = "insufficient_storage"  # ENOSPC, EDQUOT, or the disk budget is too small
READ_ONLY_CODE = "read_only_storage"  # EROFS
STORAGE_ERROR_CODE = "storage_error"  # any other OS error: I/O error, permissions, ...
STORAGE_ERRNO_CODES = {errno.ENOSPC: NO_SPACE_CODE,
                       getattr(errno, "EDQUOT", errno.ENOSPC): NO_SPACE_CODE,
                       errno.EROFS: READ_ONLY_CODE, errno.EIO: STORAGE_ERROR_CODE}


def storage_code(exc: BaseException) -> str:
    """The error code for an OS error while writing a snapshot (every one is a server fault)."""
    return STORAGE_ERRNO_CODES.get(getattr(exc, "errno", None), STORAGE_ERROR_CODE)
