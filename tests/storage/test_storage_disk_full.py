"""A full disk: every write path refuses cleanly, keeps what it stored, and works again once space is back.

Injected (``FullDisk``: ENOSPC for chosen files, a write cut short first) for
each step on its own, and real (a small tmpfs filled up, root only) for the log
and the lmdb store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.storage.errors import (
    AppendFailed,
    LogIOError,
    StoreIOError,
    disk_full,
    storage_refusal,
)
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.testing import FullDisk, TmpfsUnavailable, fill_up, small_tmpfs
from delaymq.storage.writer import open_log_writer


def record(i: int, size: int = 40) -> bytes:
    return encode(RecordKind.MESSAGE, f"record-{i:05d}-".encode().ljust(size, b"."))


def payloads(log: SegmentedLog) -> list[bytes]:
    return [r.payload for r in log.iter_from(log.start_offset)]


@pytest.fixture
def full_disk() -> Iterator[FullDisk]:
    with FullDisk() as disk:
        yield disk


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    try:
        with small_tmpfs(tmp_path / "tmpfs", size="2m") as mounted:
            yield mounted
    except TmpfsUnavailable as error:
        pytest.skip(str(error))


def test_a_write_cut_short_by_a_full_disk_leaves_no_torn_record(tmp_path: Path, full_disk: FullDisk) -> None:
    with SegmentedLog.open(tmp_path) as log:
        first = log.append(record(0) + record(1))
        end = log.end_offset
        full_disk.fill(tmp_path, partial=True)  # half of the next batch fits, then nothing
        with pytest.raises(LogIOError) as error:
            log.append(record(2) + record(3))
        assert disk_full(error.value) and "No space left" in str(error.value)
        assert log.end_offset == end
        assert os.path.getsize(tmp_path / "00000000000000000000") == end  # the half is cut off
        full_disk.free()
        assert log.append(record(4)) == end  # right after the last whole record
        assert first == 0
    with SegmentedLog.open(tmp_path) as log:
        assert [p[:12] for p in payloads(log)] == [b"record-00000", b"record-00001", b"record-00004"]


async def test_a_failed_fsync_under_sync_is_cut_back_and_the_writer_goes_on(
    tmp_path: Path, full_disk: FullDisk, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.storage")
    with SegmentedLog.open(tmp_path) as log:
        async with open_log_writer(log, flush="sync") as writer:
            await writer.append(record(0))
            end = log.end_offset
            full_disk.fill(tmp_path, fsync=True)  # the write lands in the page cache; the fsync fails
            for i in (1, 2, 3):
                with pytest.raises(AppendFailed) as error:
                    await writer.append(record(i))
                assert disk_full(error.value)
                assert log.end_offset == log.flushed_offset == end  # nobody was told: cut
            full_disk.free()
            assert await writer.append(record(4)) == end
            assert writer.statistics().failed_appends == 3
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "delaymq.storage.writer"]
    assert [level for level, _ in lines] == [logging.WARNING, logging.INFO]  # once per outage
    assert "the disk is full" in lines[0][1] and "3 refused" in lines[1][1]
    with SegmentedLog.open(tmp_path) as log:
        assert [p[:12] for p in payloads(log)] == [b"record-00000", b"record-00004"]


async def test_a_segment_that_could_not_be_created_is_created_once_space_is_back(
    tmp_path: Path, full_disk: FullDisk
) -> None:
    with SegmentedLog.open(tmp_path, segment_size=100) as log:
        async with open_log_writer(log) as writer:
            await writer.append(record(0, 80))
            # The new segment's file is created, but the folder's fsync fails.
            full_disk.fill(tmp_path, fsync=True)
            with pytest.raises(AppendFailed) as error:
                await writer.append(record(1, 80))
            assert disk_full(error.value)
            assert log.segments() == [(0, len(record(0, 80)))]
            full_disk.free()
            second = await writer.append(record(1, 80))
            assert log.segments() == [(0, second), (second, len(record(1, 80)))]
    with SegmentedLog.open(tmp_path, segment_size=100) as log:
        assert [p[:12] for p in payloads(log)] == [b"record-00000", b"record-00001"]


def test_a_full_state_store_refuses_a_write_whole_and_takes_it_later(tmp_path: Path, full_disk: FullDisk) -> None:
    with StateStore.open(tmp_path) as store:
        store.put("db", b"kept", b"1")
        full_disk.fill(tmp_path)
        with pytest.raises(StoreIOError) as error:
            with store.write() as batch:
                batch.put("db", b"a", b"2")
                batch.delete("db", b"kept")
        assert disk_full(error.value)
        assert store.items("db") == [(b"kept", b"1")]  # nothing of the batch
        full_disk.free()
        with store.write() as batch:
            batch.put("db", b"a", b"2")
        assert store.items("db") == [(b"a", b"2"), (b"kept", b"1")]


def test_a_refusal_says_the_disk_is_full_and_is_retryable() -> None:
    full = LogIOError("append of 10 bytes failed")
    full.__cause__ = OSError(28, "No space left on device")
    wrapped = AppendFailed("append failed")
    wrapped.__cause__ = full
    refusal = storage_refusal("SEND: the message log could not store the batch", wrapped)
    assert refusal.code == "unavailable"
    assert "SEND: the message log could not store the batch: the disk is full" in str(refusal)
    broken = storage_refusal("SEND", LogIOError("fsync failed: [Errno 5] Input/output error"))
    assert broken.code == "unavailable" and "disk is full" not in str(broken)
    assert not disk_full(ValueError("no"))


# ------------------------------------------------------------------ a real one


def test_a_real_full_disk_refuses_appends_and_the_log_goes_on_once_freed(tmpfs: Path) -> None:
    filler = tmpfs / "filler"
    with SegmentedLog.open(tmpfs / "log") as log:
        log.append(record(0))
        log.flush()
        fill_up(filler)
        acknowledged = [0]
        refused = 0
        for i in range(1, 2000):  # the page of the segment's tail fills, then no more
            try:
                log.append(record(i, 300))
                log.flush()
            except LogIOError as error:
                assert disk_full(error)
                refused += 1
                break
            acknowledged.append(i)
        assert refused == 1
        end = log.end_offset
        assert os.path.getsize(tmpfs / "log" / "00000000000000000000") == end
        filler.unlink()
        log.append(record(9999, 300))
        acknowledged.append(9999)
    with SegmentedLog.open(tmpfs / "log") as log:
        assert [p[:12] for p in payloads(log)] == [f"record-{i:05d}".encode() for i in acknowledged]


def test_a_real_full_disk_refuses_lmdb_writes_and_the_store_goes_on_once_freed(tmpfs: Path) -> None:
    filler = tmpfs / "filler"
    with StateStore.open(tmpfs / "state", map_size=8 << 20) as store:
        fill_up(filler)
        written = 0
        with pytest.raises(StoreIOError) as error:
            for batch_number in range(10_000):
                with store.write() as batch:
                    for j in range(50):
                        batch.put("db", f"{batch_number:05d}-{j:02d}".encode(), b"v" * 200)
                written = batch_number + 1
        assert disk_full(error.value), error.value
        filler.unlink()
        with store.write() as batch:
            batch.put("db", b"after", b"1")
        assert len(store.items("db")) == written * 50 + 1
    with StateStore.open(tmpfs / "state", map_size=8 << 20) as store:
        assert len(store.items("db")) == written * 50 + 1


async def test_a_real_full_disk_under_the_writer(tmpfs: Path) -> None:
    filler = tmpfs / "filler"
    with SegmentedLog.open(tmpfs / "log") as log:
        async with open_log_writer(log, flush="sync") as writer:
            fill_up(filler)
            acknowledged: list[int] = []
            failures = 0

            async def appender(task: int) -> None:
                nonlocal failures
                for i in range(50):
                    number = task * 1000 + i
                    try:
                        await writer.append(record(number, 200))
                    except AppendFailed as error:
                        assert disk_full(error)
                        failures += 1
                    else:
                        acknowledged.append(number)

            async with trio.open_nursery() as nursery:
                for task in range(4):
                    nursery.start_soon(appender, task)
            assert failures > 0
            filler.unlink()
            await writer.append(record(99_999, 200))
            acknowledged.append(99_999)
    with SegmentedLog.open(tmpfs / "log") as log:
        assert sorted(p[:12] for p in payloads(log)) == sorted(f"record-{i:05d}".encode() for i in acknowledged)
