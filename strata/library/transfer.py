"""One file from the hub into the library, resumable: the bytes go to a part file that outlives
a cancel, a dropped connection or a killed process, and the next transfer asks only for the rest.

huggingface_hub 2.x writes each attempt to a fresh uniquely named temporary file and deletes it
on failure (huggingface/huggingface_hub#4228), so a pull stopped at 19 of 20 GB would start that
file again from zero; Strata keeps huggingface_hub for the listing, the URL, the headers and
the HTTP session, and streams the body itself.

Layout: TARGET/.strata-partial/FILE.part holds the bytes so far and FILE.part.json what they
are a prefix of (the hub's SHA-256 of the file, or its git blob id); a part of another version
of the file is discarded, never appended to. The finished file is checked against the hub's
SHA-256 (hashed as it arrives: a resumed part is read once) and renamed into place.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from strata.library.hub_names import inside
from strata.library.pull_errors import DownloadError, HubOfflineError, PullCancelled, PullError

log = logging.getLogger(__name__)

PARTIAL_DIR = ".strata-partial"
_MAX_ATTEMPTS = 5  # in a row without a byte arriving; an attempt that made progress resets it
_RETRY_WAIT_S = 0.5  # doubled after each failed attempt, up to _MAX_RETRY_WAIT_S
_MAX_RETRY_WAIT_S = 8.0
_HASH_CHUNK_BYTES = 8 << 20
_LOCK_WAIT_S = 2.0  # a pull that was just cancelled lets go of the part within a chunk
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

BytesCallback = Callable[[int], None]  # completed bytes of the file so far


@dataclass(frozen=True)
class Source:
    """What to fetch: url (pinned to a commit), headers (user agent, token), what the listing
    says the file is (identity: its SHA-256, else its git blob id), the repository it is of,
    and a label for messages."""

    url: str
    headers: dict[str, str]
    identity: str
    size_bytes: int | None
    sha256: str | None
    repo: str  # OWNER/REPO
    label: str  # 'FILE of OWNER/REPO'


@dataclass(frozen=True)
class PartRecord:
    """The json beside a part: which remote file the part is a prefix of."""

    identity: str
    size_bytes: int | None
    url: str


def part_path(target: Path, name: str) -> Path:
    """Where the part of target/name is kept while it downloads."""
    return target / PARTIAL_DIR / f"{name}.part"


class _Part:
    """The part file open for appending, with the SHA-256 of what it holds so far."""

    def __init__(self, path: Path, cancel: threading.Event | None):
        self.path = path
        self.digest = hashlib.sha256()
        self.done_bytes = 0
        with open(path, "ab+") as f:  # created when absent; read once to hash what it holds
            f.seek(0)
            while chunk := f.read(_HASH_CHUNK_BYTES):
                check_cancel(cancel)
                self.digest.update(chunk)
                self.done_bytes += len(chunk)
        self.file: BinaryIO = open(path, "ab")  # noqa: SIM115 - closed by close()

    def append(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.digest.update(chunk)
        self.done_bytes += len(chunk)

    def restart(self) -> None:
        """Drop what the part holds: the server sends the whole file again."""
        self.file.truncate(0)
        self.digest = hashlib.sha256()
        self.done_bytes = 0

    def close(self) -> None:
        self.file.close()


class _Restart(Exception):
    """The server's answer does not continue the part (a 416, another range): start over."""


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise PullCancelled("the pull was cancelled; pulling it again resumes where it stopped")


def fetch(source: Source, target: Path, name: str, *, on_bytes: BytesCallback,
          on_verify: Callable[[], None] | None = None,
          cancel: threading.Event | None = None) -> Path:
    """Bring source into target/name through its part, resuming a part left by an earlier
    pull; returns target/name.

    on_bytes gets the completed byte count (first the resumed offset, then after each chunk);
    on_verify is called once the bytes are in, before they are checked against source.sha256.
    A cancel stops between chunks with PullCancelled and keeps the part; a dropped connection
    is retried from the part a few times; a file whose SHA-256 differs from the hub's is
    deleted with PullError. A name that would leave target is refused (BadListingError).
    """
    from filelock import FileLock, Timeout  # a dependency of huggingface_hub

    dest = inside(target, name, source.repo)
    if _is_in_place(source, dest, on_bytes, on_verify, cancel):
        return dest
    part = part_path(target, name)
    record_path = part.with_name(part.name + ".json")
    lock_path = part.with_name(part.name + ".lock")
    try:
        part.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(f"cannot write the part of {source.label}: {exc}") from None
    lock = FileLock(str(lock_path), timeout=_LOCK_WAIT_S)
    try:
        lock.acquire()
    except Timeout:
        raise PullError(f"{source.label} is being pulled by another pull; wait for it to "
                        "finish or stop it") from None
    try:
        _discard_stale(source, part, record_path)
        try:
            record_path.write_text(json.dumps(asdict(PartRecord(
                source.identity, source.size_bytes, source.url))))
            writer = _Part(part, cancel)
        except OSError as exc:
            raise DownloadError(f"cannot write the part of {source.label}: {exc}") from None
        try:
            on_bytes(writer.done_bytes)
            _transfer(source, writer, on_bytes, cancel)
        finally:
            writer.close()
        if source.sha256 and on_verify is not None:
            on_verify()
        return _finish(source, writer, dest, record_path)
    finally:
        lock.release()
        # the lock file goes with its part only: unlinked earlier, a second pull could lock a
        # new file while the first still holds the old one
        if not part.exists():
            lock_path.unlink(missing_ok=True)
            _remove_empty(part.parent, target / PARTIAL_DIR)


def _is_in_place(source: Source, dest: Path, on_bytes: BytesCallback,
                 on_verify: Callable[[], None] | None, cancel: threading.Event | None) -> bool:
    """Whether dest already holds the file (a pull run again): same size and SHA-256. A file
    the hub keeps no SHA-256 for is small (outside LFS) and fetched again."""
    if not source.sha256 or not dest.is_file() or dest.stat().st_size != source.size_bytes:
        return False
    on_bytes(source.size_bytes)
    if on_verify is not None:
        on_verify()
    digest = hashlib.sha256()
    with open(dest, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            check_cancel(cancel)
            digest.update(chunk)
    return digest.hexdigest() == source.sha256


def _discard_stale(source: Source, part_path: Path, record_path: Path) -> None:
    """Delete a part that belongs to another version of the file, or is longer than it."""
    if not part_path.exists():
        return
    try:
        record = PartRecord(**json.loads(record_path.read_text()))
    except (OSError, ValueError, TypeError):
        record = None
    size_bytes = part_path.stat().st_size
    if record is None or record.identity != source.identity:
        log.info("%s: the part is of another version of the file; starting again",
                 source.label)
    elif source.size_bytes is not None and size_bytes > source.size_bytes:
        log.info("%s: the part is longer than the file; starting again", source.label)
    else:
        return
    part_path.unlink()


def _transfer(source: Source, part: _Part, on_bytes: BytesCallback,
              cancel: threading.Event | None) -> None:
    """GET the rest of the file into part, retrying a dropped connection from where it got."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    num_failed = 0  # attempts in a row that brought no byte
    wait_s = _RETRY_WAIT_S
    while True:
        check_cancel(cancel)
        if source.size_bytes is not None and part.done_bytes == source.size_bytes:
            return  # complete (a part left whole by a pull stopped before its rename)
        before_bytes = part.done_bytes
        try:
            _get_rest(source, part, on_bytes, cancel)
            if source.size_bytes is None or part.done_bytes == source.size_bytes:
                return
            failure = f"the body ended at byte {part.done_bytes} of {source.size_bytes}"
        except _Restart:
            continue
        except OfflineModeIsEnabled:  # a ConnectionError, but not one to retry
            raise offline_error(f"download {source.label}") from None
        except transport_errors() as exc:
            failure = str(exc) or type(exc).__name__
        except OSError as exc:  # the disk (full, gone): the part so far is kept
            raise DownloadError(f"writing {source.label} failed: {exc}; the part is kept, "
                                "pull again to resume") from None
        num_failed = 0 if part.done_bytes > before_bytes else num_failed + 1
        if num_failed >= _MAX_ATTEMPTS:
            raise DownloadError(f"downloading {source.label} failed: {failure}; the part is "
                                "kept, pull again to resume")
        log.warning("%s: %s; resuming at byte %d", source.label, failure, part.done_bytes)
        if cancel is not None:
            cancel.wait(wait_s)
        else:
            time.sleep(wait_s)
        wait_s = min(wait_s * 2, _MAX_RETRY_WAIT_S)


def _get_rest(source: Source, part: _Part, on_bytes: BytesCallback,
              cancel: threading.Event | None) -> None:
    """One GET from part.done_bytes on, appended to part as it arrives."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    # identity: a range counts bytes of the file, not of a gzip of it (CDNs ignore a range
    # on a compressed answer)
    headers = {**source.headers, "Accept-Encoding": "identity"}
    if part.done_bytes:
        headers["Range"] = f"bytes={part.done_bytes}-"
    # no retries on exceptions inside: one raised while reading the body cannot be retried by
    # http_stream_backoff (it would yield twice); _transfer retries, from the part
    with http_stream_backoff("GET", source.url, headers=headers, retry_on_exceptions=(),
                             timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        if response.status_code == 416:  # the part reaches past the file: it is not its prefix
            log.info("%s: the server refused the part's range; starting again", source.label)
            part.restart()
            raise _Restart
        try:
            hf_raise_for_status(response)
        except HfHubHTTPError as exc:
            raise DownloadError(f"downloading {source.label} failed: "
                                f"{str(exc).splitlines()[0]}") from None
        if response.status_code == 206:
            _check_range(source, part, response.headers.get("Content-Range", ""))
        elif part.done_bytes:  # a 200 to a ranged request: the whole file comes again
            log.info("%s: the server ignored the range; starting again", source.label)
            part.restart()
            on_bytes(0)
        for chunk in response.iter_raw():  # as it arrives: a chunk held back would be lost
            check_cancel(cancel)
            part.append(chunk)
            if source.size_bytes is not None and part.done_bytes > source.size_bytes:
                part.restart()
                raise DownloadError(f"{source.label} is longer than the hub listed it; pull "
                                    "again")
            on_bytes(part.done_bytes)
        part.file.flush()


def _check_range(source: Source, part: _Part, content_range: str) -> None:
    """A 206 must continue the part exactly, and be of a file of the listed size."""
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    total = match.group(3) if match else None
    if match is None or int(match.group(1)) != part.done_bytes or (
            source.size_bytes is not None and total not in ("*", str(source.size_bytes))):
        log.info("%s: the server answered range %r for byte %d on; starting again",
                 source.label, content_range, part.done_bytes)
        part.restart()
        raise _Restart


def _finish(source: Source, part: _Part, dest: Path, record_path: Path) -> Path:
    """Check the size and SHA-256, then move the part into place (atomic: one file system)."""
    if source.size_bytes is not None and part.done_bytes != source.size_bytes:
        raise DownloadError(f"{source.label} arrived with {part.done_bytes} of "
                            f"{source.size_bytes} bytes; the part is kept, pull again")
    if source.sha256 and part.digest.hexdigest() != source.sha256:
        part.path.unlink()
        record_path.unlink(missing_ok=True)
        raise PullError(f"{source.label} arrived corrupted (SHA-256 differs from the hub's); "
                        "it was deleted, pull again")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part.path, dest)
    except OSError as exc:  # a folder of that name is a file, the disk went away
        raise DownloadError(f"cannot put {source.label} in place: {exc}; the part is kept, "
                            "pull again") from None
    record_path.unlink(missing_ok=True)
    return dest


def _remove_empty(folder: Path, root: Path) -> None:
    """The partial directories from folder up to root, once no part is left in them."""
    while _rmdir(folder) and folder != root:
        folder = folder.parent


def _rmdir(folder: Path) -> bool:
    try:
        folder.rmdir()
    except OSError:  # not empty: another file's part is in it
        return False
    return True


def offline_error(what: str) -> HubOfflineError:
    """The one-line error for a pull stopped by offline mode; what: 'list OWNER/REPO'."""
    return HubOfflineError(f"cannot {what}: HF_HUB_OFFLINE is set, so the hub is not "
                           "contacted; unset it (or TRANSFORMERS_OFFLINE) and pull again")


@functools.cache
def transport_errors() -> tuple[type[Exception], ...]:
    """The HTTP client's network errors: huggingface_hub 1.x uses httpx, 2.x httpx2."""
    errors: list[type[Exception]] = []
    for module in ("httpx", "httpx2"):
        try:
            errors.append(__import__(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)
