"""KV snapshots of conversation slots: the cache protocol, the file format and the store.

- kv_state.py    KVLayout, SlotCache (live) and KVSnapshot (host copy): state, metadata,
                 from_state, nbytes
- format.py      the checked snapshot file: write (temp + fsync + rename) and verified read
- store.py       SnapshotStore: RAM first, then files, within byte budgets
- safe_files.py  private files (0600, O_EXCL temp names) in a private directory (0700);
                 reads refuse FIFOs, devices and symlinks
- fingerprint.py model_fingerprint: which model a snapshot belongs to
- errors.py      SnapshotInvalid(reason), SnapshotWriteError(code), SnapshotNameError
"""

from strata.engine.core.snapshots.errors import (
    INVALID_REASONS,
    SnapshotInvalid,
    SnapshotNameError,
    SnapshotWriteError,
)
from strata.engine.core.snapshots.fingerprint import model_fingerprint
from strata.engine.core.snapshots.kv_state import KVLayout, KVSnapshot, SlotCache
from strata.engine.core.snapshots.store import SnapshotStore, check_filename

__all__ = [
    "INVALID_REASONS", "KVLayout", "KVSnapshot", "SlotCache", "SnapshotInvalid",
    "SnapshotNameError", "SnapshotStore", "SnapshotWriteError", "check_filename",
    "model_fingerprint",
]
