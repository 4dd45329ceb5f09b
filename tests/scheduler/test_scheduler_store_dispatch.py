"""Dispatch logs: what was delivered survives reopen, torn tails are cut, completeness."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.protocol.records import encode_message
from delaymq.scheduler.dispatchlog import DispatchLog, read_delivered
from delaymq.scheduler.hours import HOUR_MS, CorruptSchedule, ScheduleError
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.schedulelog import DISPATCH_SUFFIX

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS


def test_appended_entries_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "h.dispatch"
    with DispatchLog.open(path) as log:
        assert log.count == 0 and log.delivered() == set()
        assert log.append([5, 1, 9]) == 3
        assert log.append([9, 2]) == 1  # 9 again: written, counted once
        assert log.append([]) == 0
        log.flush()
        assert 9 in log and 3 not in log and -1 not in log
    with DispatchLog.open(path) as log:
        assert log.delivered() == {1, 2, 5, 9} and log.count == 4
        log.append(range(1000, 3000))
    assert read_delivered(path) == {1, 2, 5, 9} | set(range(1000, 3000))


@pytest.mark.parametrize("damage", ["cut mid-record", "cut mid-header", "garbage tail", "flipped byte"])
def test_a_torn_tail_is_cut_on_open(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "h.dispatch"
    with DispatchLog.open(path) as log:
        log.append([1, 2, 3])
        size = log.size
        log.append([4, 5])
    data = path.read_bytes()
    if damage == "cut mid-record":
        path.write_bytes(data[:-3])
    elif damage == "cut mid-header":
        path.write_bytes(data[: size + 5])
    elif damage == "garbage tail":
        path.write_bytes(data + b"\x00\x01\x02")
        size = len(data)
    else:
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with DispatchLog.open(path) as log:
        assert log.size == size == path.stat().st_size
        expected = {1, 2, 3, 4, 5} if damage == "garbage tail" else {1, 2, 3}
        assert log.delivered() == expected
        log.append([7])
    with DispatchLog.open(path) as log:
        assert log.delivered() == expected | {7}


def test_a_record_that_checks_but_is_not_a_dispatch_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "h.dispatch"
    good = encode(RecordKind.DISPATCH, (1).to_bytes(4, "big"))
    path.write_bytes(good + encode(RecordKind.STATE, b"abcd"))
    with pytest.raises(CorruptSchedule, match="kind 3, not DISPATCH"):
        DispatchLog.open(path)
    path.write_bytes(encode(RecordKind.DISPATCH, b"abcde"))
    with pytest.raises(CorruptSchedule, match="5 bytes, not whole u32 entries"):
        DispatchLog.open(path)


def test_entry_numbers_outside_u32_are_refused(tmp_path: Path) -> None:
    with DispatchLog.open(tmp_path / "h.dispatch") as log:
        with pytest.raises(ScheduleError, match="from 0 to 4294967295"):
            log.append([1, -1])
        assert log.count == 0


def test_store_delivered_pending_and_complete(tmp_path: Path, sched: SimpleNamespace) -> None:
    records = [encode_message(f"m{i}", "s", deliver_at=BASE + i * 100, created_at=BASE) for i in range(50)]
    records += [encode_message("late", "s", deliver_at=BASE + HOUR_MS + 1, created_at=BASE)]
    with sched.folder(tmp_path) as (messages, store):
        messages.append(b"".join(records))
        messages.flush()
        replay_until_caught_up(messages, store)
        assert store.undispatched_hours() == [HOUR, HOUR + 1]
        assert store.pending(HOUR) == 50 and not store.is_complete(HOUR)
        assert store.delivered(HOUR) == set()
        assert not store.path_of(HOUR, DISPATCH_SUFFIX).exists()  # asking creates nothing
        assert store.record_dispatched(HOUR, range(0, 30)) == 30
        assert store.record_dispatched(HOUR, [29, 30]) == 1
        with pytest.raises(ScheduleError, match="entry_no 50 is outside 0..49"):
            store.record_dispatched(HOUR, [49, 50])
        store.flush_dispatched()
        assert store.pending(HOUR) == 19 and store.dispatched_count(HOUR) == 31
        assert store.is_complete(HOUR + 7)  # no entries, nothing to deliver
    with sched.folder(tmp_path) as (_, store):
        assert store.delivered(HOUR) == set(range(31))
        store.record_dispatched(HOUR, range(31, 50))
        store.record_dispatched(HOUR + 1, [0])
        assert store.is_complete(HOUR) and store.is_complete(HOUR + 1)
        assert store.undispatched_hours() == []


def test_dispatch_logs_closed_to_bound_open_files_reopen_whole(tmp_path: Path, sched: SimpleNamespace) -> None:
    records = [encode_message(f"m{h}", "s", deliver_at=BASE + h * HOUR_MS, created_at=BASE) for h in range(6)]
    with sched.folder(tmp_path, max_open_dispatch_logs=2) as (messages, store):
        messages.append(b"".join(records))
        messages.flush()
        replay_until_caught_up(messages, store)
        for h in range(6):
            store.record_dispatched(HOUR + h, [0])
        assert all(store.is_complete(HOUR + h) for h in range(6))
        assert [store.delivered(HOUR + h) for h in range(6)] == [{0}] * 6
