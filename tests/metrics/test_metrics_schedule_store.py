"""The schedule store's log sizes and fsync durations, as the scheduler's metrics show them.

``ScheduleStore.log_bytes`` is a running count, never a walk of the folder: these tests
compare it with the sizes of the files on disk after filing, dispatch records, a
restart (clean, and after a crash left torn tails) and the deletion of an hour; and the
fsync histograms with the fsyncs the store counted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from delaymq.protocol.histogram import LatencyHistogram
from delaymq.protocol.records import encode_message
from delaymq.scheduler.hours import DISPATCH_SUFFIX, HOUR_MS, INDEX_SUFFIX, LOG_SUFFIX, hour_name

from ..conftest import ScheduleFolder

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS
SCHEDULE_SUFFIXES = ("log", "index", "heads")


def messages(hours: int, count: int, tag: str) -> list[bytes]:
    """``count`` records spread over ``hours`` hours from ``HOUR``, of varied sizes."""
    return [
        encode_message(
            f"{tag}{i}",
            "orders",
            body=b"x" * (i % 37),
            deliver_at=BASE + (i % hours) * HOUR_MS + i * 13,
            created_at=BASE,
        )
        for i in range(count)
    ]


def disk_bytes(folder: Path) -> dict[str, int]:
    """What the hours' files hold on disk: ``YYYYMMDDHH.{log,index,heads}`` and ``.dispatch``."""
    sizes = {"schedule": 0, "dispatch": 0}
    for path in folder.iterdir():
        stem, _, suffix = path.name.partition(".")
        if len(stem) != 10 or not stem.isdigit():
            continue
        if suffix in SCHEDULE_SUFFIXES:
            sizes["schedule"] += path.stat().st_size
        elif suffix == "dispatch":
            sizes["dispatch"] += path.stat().st_size
    return sizes


def histogram_count(wire: dict[str, object]) -> int:
    return LatencyHistogram.from_wire(wire).count  # from_wire checks the map is whole


@pytest.fixture
def folder(store_folder: ScheduleFolder) -> ScheduleFolder:
    return store_folder


def test_log_bytes_follow_filing_and_dispatch_records(folder: ScheduleFolder) -> None:
    store = folder.store
    assert store.log_bytes() == {"schedule": 0, "dispatch": 0}
    folder.add(*messages(3, 60, "a"))
    assert store.log_bytes() == disk_bytes(folder.schedule)
    assert store.log_bytes()["schedule"] > 0 and store.log_bytes()["dispatch"] == 0
    folder.add(*messages(5, 40, "b"))  # two more hours, and more entries in the first three
    store.record_dispatched(HOUR, range(10))
    store.record_dispatched(HOUR + 1, [0, 1])
    store.record_dispatched(HOUR, [3, 4])  # recorded again: the bytes are written all the same
    assert store.log_bytes() == disk_bytes(folder.schedule)
    assert store.log_bytes()["dispatch"] > 0


def test_log_bytes_after_a_restart_are_what_the_files_hold(folder: ScheduleFolder) -> None:
    folder.add(*messages(4, 80, "a"))
    folder.store.record_dispatched(HOUR + 2, range(5))
    folder.store.flush_dispatched()
    before = folder.store.log_bytes()
    folder.reopen()
    assert folder.store.log_bytes() == before == disk_bytes(folder.schedule)
    # And counting goes on from there.
    folder.add(*messages(6, 30, "b"))
    folder.store.record_dispatched(HOUR + 5, range(3))
    assert folder.store.log_bytes() == disk_bytes(folder.schedule)


def test_log_bytes_after_a_crash_left_torn_tails_are_what_recovery_kept(folder: ScheduleFolder) -> None:
    folder.add(*messages(3, 50, "a"))
    folder.store.record_dispatched(HOUR, range(7))
    folder.close()
    # A crash midway: bytes past the committed end of an hour's schedule log and index,
    # and half a record at the end of a dispatch log.
    name = hour_name(HOUR + 1)
    for suffix, junk in ((LOG_SUFFIX, b"\x00" * 300), (INDEX_SUFFIX, b"\x07" * 40)):
        with open(folder.schedule / (name + suffix), "ab") as file:
            file.write(junk)
    dispatch = folder.schedule / (hour_name(HOUR) + DISPATCH_SUFFIX)
    with open(dispatch, "ab") as file:
        file.write(b"\x01\x02\x03")
    folder.open()
    store = folder.store
    assert store.log_bytes() == disk_bytes(folder.schedule)  # the dispatch log's tail is cut when it opens
    assert store.pending(HOUR) == store.entries(HOUR) - 7  # opens the dispatch log: its torn tail is cut
    assert store.log_bytes() == disk_bytes(folder.schedule)
    assert os.path.getsize(dispatch) == store.log_bytes()["dispatch"]


def test_log_bytes_drop_by_what_a_deleted_hour_held(folder: ScheduleFolder) -> None:
    folder.add(*messages(3, 30, "a"))
    store = folder.store
    store.record_dispatched(HOUR, range(store.entries(HOUR)))
    store.record_dispatched(HOUR + 1, [0])
    before = disk_bytes(folder.schedule)
    store.delete_hour(HOUR)
    after = store.log_bytes()
    assert after == disk_bytes(folder.schedule)
    assert after["schedule"] < before["schedule"] and after["dispatch"] < before["dispatch"] > 0
    # An hour whose dispatch log was not opened since the restart is counted as well.
    folder.reopen()
    store = folder.store
    name = hour_name(HOUR + 1)
    held = sum(path.stat().st_size for path in folder.schedule.glob(name + ".*") if path.suffix != DISPATCH_SUFFIX)
    store.delete_hour(HOUR + 1, force=True)
    assert store.log_bytes() == disk_bytes(folder.schedule) == {"schedule": after["schedule"] - held, "dispatch": 0}
    folder.reopen()
    assert folder.store.log_bytes() == disk_bytes(folder.schedule)


def test_each_filing_and_dispatch_fsync_is_timed(folder: ScheduleFolder) -> None:
    folder.add(*messages(2, 20, "a"))  # few hours: a fdatasync per file
    folder.add(*messages(12, 120, "b"))  # many: one syncfs
    store = folder.store
    stats = store.statistics()
    timed = store.fsync_durations_us()
    assert stats.fsyncs > 0
    assert histogram_count(timed["schedule"]) == stats.fsyncs + stats.syncfs
    assert histogram_count(timed["dispatch"]) == 0
    store.record_dispatched(HOUR, [0, 1])
    store.record_dispatched(HOUR + 1, [0])
    store.flush_dispatched()  # two logs appended to: two fsyncs
    store.flush_dispatched()  # nothing new: none
    store.record_dispatched(HOUR, [2])
    store.flush_dispatched()
    assert histogram_count(store.fsync_durations_us()["dispatch"]) == 3
