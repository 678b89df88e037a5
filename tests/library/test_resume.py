"""A pull stopped mid-file resumes on the next one: the part under .strata-partial, the Range
request the hub sees, and the checks that keep a wrong part from becoming the model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from strata.library import transfer
from strata.library.pull import DownloadError, PullCancelled, PullError, PullProgress, pull
from strata.library.transfer import PartRecord

NAME = "tiny-Q8_0.gguf"
SPEC = "acme/tiny-GGUF:Q8_0"


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(transfer, "_RETRY_WAIT_S", 0.0)


def part_of(models_dir: Path) -> Path:
    return models_dir / "acme/tiny-GGUF" / transfer.PARTIAL_DIR / f"{NAME}.part"


def leave_part(models_dir: Path, data: bytes, identity: str) -> Path:
    """A part as an interrupted pull leaves it: the bytes and the record beside them."""
    part = part_of(models_dir)
    part.parent.mkdir(parents=True)
    part.write_bytes(data)
    record = PartRecord(identity, None, "http://hub/x")
    part.with_name(part.name + ".json").write_text(json.dumps(asdict(record)))
    return part


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_a_cancelled_pull_resumes_with_the_rest_of_the_file(hub, tmp_path, gguf_bytes):
    hub.chunk_bytes, hub.chunk_delay_s = 1024, 0.01
    cancel = threading.Event()

    def stop_halfway(report: PullProgress) -> None:
        if report.completed_bytes >= 2048:
            cancel.set()

    with pytest.raises(PullCancelled, match="resumes"):
        await asyncio.to_thread(pull, SPEC, tmp_path, progress=False, on_progress=stop_halfway,
                                cancel=cancel)
    target = tmp_path / "acme/tiny-GGUF" / NAME
    assert not target.exists()
    part_bytes = part_of(tmp_path).stat().st_size
    assert 2048 <= part_bytes < len(gguf_bytes)
    record = json.loads(part_of(tmp_path).with_name(f"{NAME}.part.json").read_text())
    assert record["identity"] == sha256(gguf_bytes)

    hub.ranges.clear()
    hub.served_bytes.clear()
    reports: list[PullProgress] = []
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False,
                                   on_progress=reports.append)
    assert hub.ranges == [(NAME, f"bytes={part_bytes}-")]  # only the rest was asked for
    assert hub.served_bytes == {NAME: len(gguf_bytes) - part_bytes}  # and only it came
    assert sha256(path.read_bytes()) == sha256(gguf_bytes)
    assert reports[0].completed_bytes == part_bytes  # progress starts where the part ends
    assert reports[-1].phase == "verifying"
    assert not (tmp_path / "acme/tiny-GGUF" / transfer.PARTIAL_DIR).exists()


async def test_a_part_of_another_revision_is_discarded(hub, tmp_path, gguf_bytes):
    leave_part(tmp_path, gguf_bytes[:1000], identity=sha256(b"an older upload"))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, None)]  # the whole file again, not appended to the old part
    assert path.read_bytes() == gguf_bytes


async def test_a_dropped_connection_resumes_within_the_pull(hub, tmp_path, gguf_bytes):
    hub.chunk_bytes = 1024
    hub.drop_after_bytes[NAME] = 3000
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, None), (NAME, "bytes=3000-")]
    assert hub.served_bytes == {NAME: len(gguf_bytes)}  # every byte sent once
    assert path.read_bytes() == gguf_bytes


async def test_a_corrupted_part_fails_the_checksum_and_is_deleted(hub, tmp_path, gguf_bytes):
    wrong = bytes(reversed(gguf_bytes[:2000]))
    leave_part(tmp_path, wrong, identity=sha256(gguf_bytes))
    with pytest.raises(PullError, match=r"SHA-256.*deleted, pull again"):
        await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, "bytes=2000-")]
    assert not part_of(tmp_path).exists()
    assert not list(tmp_path.rglob("*.gguf"))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)  # as the error says
    assert path.read_bytes() == gguf_bytes


async def test_a_part_longer_than_the_file_is_discarded(hub, tmp_path, gguf_bytes):
    leave_part(tmp_path, gguf_bytes + b"more", identity=sha256(gguf_bytes))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, None)]
    assert path.read_bytes() == gguf_bytes


async def test_a_whole_part_is_checked_and_moved_without_a_request(hub, tmp_path, gguf_bytes):
    """A pull killed between its last byte and the rename."""
    leave_part(tmp_path, gguf_bytes, identity=sha256(gguf_bytes))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == []
    assert path.read_bytes() == gguf_bytes


async def test_a_server_that_ignores_the_range_sends_it_all_again(hub, tmp_path, gguf_bytes):
    hub.honours_ranges = False
    leave_part(tmp_path, gguf_bytes[:1500], identity=sha256(gguf_bytes))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, "bytes=1500-")]
    assert hub.served_bytes == {NAME: len(gguf_bytes)}  # a 200: the part was restarted
    assert path.read_bytes() == gguf_bytes


async def test_a_range_past_the_end_starts_again(hub, tmp_path, gguf_bytes):
    """The hub answers 416 to a part the listing allows but the file does not reach (the
    listing's size is unknown here)."""
    other = b"x" * (len(gguf_bytes) + 10)
    hub.repos["acme/tiny-GGUF"][NAME] = gguf_bytes  # listed as is; the part is of its length
    leave_part(tmp_path, other[:len(gguf_bytes) + 5], identity=sha256(gguf_bytes))
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, None)]  # longer than listed: discarded before asking
    assert path.read_bytes() == gguf_bytes


async def test_a_second_pull_of_the_same_file_is_refused_while_one_runs(hub, tmp_path,
                                                                        monkeypatch):
    from filelock import FileLock

    part = part_of(tmp_path)
    part.parent.mkdir(parents=True)
    monkeypatch.setattr(transfer, "_LOCK_WAIT_S", 0.1)
    with FileLock(str(part) + ".lock"), pytest.raises(PullError, match="another pull"):
        await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)


async def test_a_connection_that_keeps_failing_ends_with_the_part_kept(hub, tmp_path,
                                                                     gguf_bytes, monkeypatch):
    monkeypatch.setattr(transfer, "_MAX_ATTEMPTS", 2)
    leave_part(tmp_path, gguf_bytes[:1000], identity=sha256(gguf_bytes))
    hub.is_broken = True
    with pytest.raises(DownloadError, match="part is kept, pull again to resume"):
        await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert part_of(tmp_path).read_bytes() == gguf_bytes[:1000]


async def test_a_file_already_in_place_is_checked_not_fetched(hub, tmp_path, gguf_bytes):
    await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    hub.ranges.clear()
    reports: list[PullProgress] = []
    await asyncio.to_thread(pull, SPEC, tmp_path, progress=False, on_progress=reports.append)
    assert hub.ranges == []
    assert [r.phase for r in reports] == ["downloading", "verifying"]
    path = tmp_path / "acme/tiny-GGUF" / NAME
    path.write_bytes(bytes(reversed(gguf_bytes)))  # same size, other bytes: fetched again
    await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, None)]
    assert path.read_bytes() == gguf_bytes


async def test_a_killed_pull_resumes(hub, tmp_path, gguf_bytes):
    """`strata pull` killed mid-file (SIGKILL: no cleanup ran) leaves a part the next uses."""
    hub.chunk_bytes, hub.chunk_delay_s = 512, 0.05
    code = ("import sys; from pathlib import Path; from strata.library.pull import pull; "
            "pull(sys.argv[1], Path(sys.argv[2]), progress=False)")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, SPEC,
                                                   str(tmp_path), env=env)
    part = part_of(tmp_path)
    deadline_s = time.monotonic() + 30
    while not (part.exists() and part.stat().st_size >= 2048):
        assert time.monotonic() < deadline_s and process.returncode is None
        await asyncio.sleep(0.02)
    process.kill()
    await process.wait()
    part_bytes = part.stat().st_size
    assert part_bytes < len(gguf_bytes)
    hub.ranges.clear()
    hub.chunk_delay_s = 0.0
    path = await asyncio.to_thread(pull, SPEC, tmp_path, progress=False)
    assert hub.ranges == [(NAME, f"bytes={part_bytes}-")]
    assert path.read_bytes() == gguf_bytes
