"""KV snapshots of conversation slots: the cache protocol, the file format and the store.

- kv_state.py    KVLayout, SlotCache (live) and KVSnapshot (host copy): state, metadata,
                 from_state, nbytes
- format.py      the checked snapshot file: write (temp + fsync + rename) and verified read
- store.py       SnapshotStore: RAM first, then files, within byte budgets
- fingerprint.py model_fingerprint: which model a snapshot belongs to
- errors.py      SnapshotInvalid(reason), SnapshotWriteError, SnapshotNameError
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
