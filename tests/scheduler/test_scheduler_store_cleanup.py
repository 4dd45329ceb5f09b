"""Cleanup: which hours may go after the retention, deleting them, and what comes back."""

from __future__ import annotations

import os
import shutil

import pytest

from delaymq.protocol.records import encode_message
from delaymq.scheduler.delayindex import ENTRY_SIZE
from delaymq.scheduler.hours import DEFAULT_RETENTION_MS, HOUR_MS, HourNotComplete, hour_name
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.schedulelog import DISPATCH_SUFFIX, INDEX_SUFFIX, LOG_SUFFIX

from ..conftest import ScheduleFolder

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS


def message(i: int, deliver_at: int) -> bytes:
    return encode_message(f"m{i}", "s", deliver_at=deliver_at, created_at=BASE)


@pytest.fixture
def folder(store_folder: ScheduleFolder) -> ScheduleFolder:
    return store_folder


def test_hours_eligible_after_retention(folder: ScheduleFolder) -> None:
    folder.add(*(message(h, BASE + h * HOUR_MS + 10) for h in range(4)))
    store = folder.store
    for h in (0, 1, 3):
        store.record_dispatched(HOUR + h, [0])
    end_of = lambda h: (HOUR + h + 1) * HOUR_MS  # noqa: E731
    assert store.hours_to_delete(end_of(0) + DEFAULT_RETENTION_MS - 1) == []
    assert store.hours_to_delete(end_of(0) + DEFAULT_RETENTION_MS) == [HOUR]
    # Hour 2 is not fully delivered: never eligible, however old.
    assert store.hours_to_delete(end_of(3) + DEFAULT_RETENTION_MS) == [HOUR, HOUR + 1, HOUR + 3]
    assert store.hours_to_delete(end_of(1), retention_ms=0) == [HOUR, HOUR + 1]


def test_delete_hour_refuses_undelivered_entries_unless_forced(folder: ScheduleFolder) -> None:
    folder.add(message(0, BASE + 1), message(1, BASE + 2), message(2, BASE + HOUR_MS))
    store = folder.store
    store.record_dispatched(HOUR, [0])
    with pytest.raises(HourNotComplete, match="still has 1 of 2 entries undelivered"):
        store.delete_hour(HOUR)
    store.record_dispatched(HOUR, [1])
    store.delete_hour(HOUR)
    store.delete_hour(HOUR + 1, force=True)
    assert store.hours_with_messages() == []
    assert sorted(os.listdir(folder.root / "schedule")) == ["FORMAT"]
    assert store.heads(HOUR).entries == 0
    folder.reopen()
    assert folder.store.hours_with_messages() == []


def test_a_late_record_for_a_deleted_hour_starts_it_afresh(folder: ScheduleFolder) -> None:
    folder.add(message(0, BASE + 1))
    folder.store.record_dispatched(HOUR, [0])
    folder.store.delete_hour(HOUR)
    folder.add(message(1, BASE + 5))
    store = folder.store
    assert store.entries(HOUR) == 1 and store.delivered(HOUR) == set()
    with store.open_hour(HOUR) as reader:
        assert reader.chain(0) == [(5, 0)]
        assert reader.read_records([0]) == [message(1, BASE + 5)]


def test_replay_going_back_after_a_repair_does_not_revive_deleted_hours(folder: ScheduleFolder) -> None:
    folder.add(*(message(i, BASE + (i % 2) * HOUR_MS + i) for i in range(100)))
    store = folder.store
    store.record_dispatched(HOUR, range(50))
    store.delete_hour(HOUR)
    folder.close()
    index = folder.root / "schedule" / (hour_name(HOUR + 1) + INDEX_SUFFIX)
    os.truncate(index, 3 * ENTRY_SIZE)  # hour + 1 damaged: replay goes back to its 4th record
    folder.open()
    assert folder.store.checkpoint < folder.log.end_offset
    replay_until_caught_up(folder.log, folder.store)
    assert folder.store.hours_with_messages() == [HOUR + 1]
    assert folder.store.entries(HOUR + 1) == 50


def test_a_deletion_cut_short_leaves_a_complete_hour_to_delete_again(folder: ScheduleFolder) -> None:
    folder.add(message(0, BASE + 1), message(1, BASE + 2))
    folder.store.record_dispatched(HOUR, [0, 1])
    schedule = folder.root / "schedule"
    saved = folder.root / "saved"
    saved.mkdir()
    for suffix in (INDEX_SUFFIX, LOG_SUFFIX, DISPATCH_SUFFIX):
        shutil.copy(folder.store.path_of(HOUR, suffix), saved)
    folder.store.delete_hour(HOUR)
    folder.close()
    for name in os.listdir(saved):  # as if the process died before unlinking the files
        shutil.copy(saved / name, schedule / name)
    folder.open()
    store = folder.store
    assert store.hours_with_messages() == [HOUR] and store.is_complete(HOUR)
    assert store.hours_to_delete((HOUR + 1) * HOUR_MS, retention_ms=0) == [HOUR]
