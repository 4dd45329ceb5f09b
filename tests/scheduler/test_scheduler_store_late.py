"""Filing LATE records: SCHEDULEd messages received after their moment, filed at the time
of receipt while each keeps the ``deliver_at`` its producer asked for."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from delaymq.protocol.records import decode_message, encode_message, scan_batch
from delaymq.scheduler.delayindex import ENTRY_SIZE
from delaymq.scheduler.hours import HOUR_MS, INDEX_SUFFIX, LOG_SUFFIX, hour_name
from delaymq.scheduler.idindex import IDS_DB, IdEntry, cancel_record
from delaymq.scheduler.indexrecords import late_record
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.schedule import ScheduleHandler
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.store import SchedulerStorage

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS  # an hour boundary in 2025
HOUR = BASE // HOUR_MS
RECEIVED = BASE + 9_000  # when the late ones came


def message(name: str, deliver_at: int) -> bytes:
    return encode_message(name, "orders", body=name.encode(), deliver_at=deliver_at, created_at=BASE - 3 * HOUR_MS)


#: In log order: one on time, two late (three hours late, and a moment late), one on time.
ON_TIME = message("on-time", BASE + 5_000)
THREE_HOURS_LATE = message("three-hours-late", BASE - 3 * HOUR_MS + 1)
A_MOMENT_LATE = message("a-moment-late", RECEIVED - 1)
LATER = message("later", BASE + 20_000)


@contextmanager
def opened(root: Path) -> Iterator[SchedulerStorage]:
    storage = SchedulerStorage.open(root, segment_size=1 << 20)
    try:
        yield storage
    finally:
        storage.close()


def write_log(root: Path) -> None:
    """The message log as the SCHEDULE handler writes it: the late ones in a LATE record."""
    with opened(root) as storage:
        log = storage.message_log
        log.append(ON_TIME + late_record([THREE_HOURS_LATE, A_MOMENT_LATE], filed_at=RECEIVED) + LATER)
        log.flush()


def filed(store: ScheduleStore) -> list[tuple[int, int, bytes]]:
    """Every entry of every hour as (hour, ms_in_hour, record), in entry order."""
    out = []
    for hour in store.hours_with_messages():
        with store.open_hour(hour) as reader:
            for n in range(reader.entries):
                entry = reader.entry(n)
                out.append((hour, entry.ms_in_hour, reader.read_records([n])[0]))
    return out


def test_late_records_are_filed_at_the_time_they_came_and_keep_their_deliver_at(tmp_path: Path) -> None:
    write_log(tmp_path)
    with opened(tmp_path) as storage:
        step = replay_until_caught_up(storage.message_log, storage.schedule)
        assert step.filed == 4
        got = filed(storage.schedule)
        # One hour only: nothing is filed into an hour before the one it came in.
        assert got == [
            (HOUR, 5_000, ON_TIME),
            (HOUR, 9_000, THREE_HOURS_LATE),  # byte for byte: the moment its producer asked for
            (HOUR, 9_000, A_MOMENT_LATE),
            (HOUR, 20_000, LATER),
        ]
        assert decode_message(got[1][2]).deliver_at == BASE - 3 * HOUR_MS + 1
        # The id index files it where it is: its hour and the moment it is filed for.
        value = IdEntry.unpack(storage.state.get(IDS_DB, b"three-hours-late"))
        assert (value.hour, value.deliver_at, value.entry) == (HOUR, RECEIVED, 1)


def test_a_cancel_after_a_late_record_takes_its_entry_out(tmp_path: Path) -> None:
    write_log(tmp_path)
    with opened(tmp_path) as storage:
        storage.message_log.append(cancel_record(["a-moment-late"], taken_at=RECEIVED + 1))
        storage.message_log.flush()
        replay_until_caught_up(storage.message_log, storage.schedule)
        assert storage.schedule.cancelled(HOUR) == [2]
        assert storage.schedule.pending(HOUR) == 3


def test_a_slave_or_a_restart_files_the_same_bytes_into_the_same_entries(tmp_path: Path) -> None:
    write_log(tmp_path / "master")
    write_log(tmp_path / "slave")
    with opened(tmp_path / "master") as storage:
        replay_until_caught_up(storage.message_log, storage.schedule)
    with opened(tmp_path / "slave") as storage:
        while storage.schedule.checkpoint < storage.message_log.end_offset:  # one record per step
            replay_until_caught_up(storage.message_log, storage.schedule, max_bytes=1)
    name = hour_name(HOUR)
    for suffix in (LOG_SUFFIX, INDEX_SUFFIX):
        master = (tmp_path / "master" / "schedule" / (name + suffix)).read_bytes()
        assert (tmp_path / "slave" / "schedule" / (name + suffix)).read_bytes() == master


def test_entries_an_hour_lost_inside_a_late_record_are_filed_again_at_the_same_moment(tmp_path: Path) -> None:
    write_log(tmp_path)
    with opened(tmp_path) as storage:
        replay_until_caught_up(storage.message_log, storage.schedule)
        before = filed(storage.schedule)
    # Damage: the hour keeps its first two entries; replay must go back into the LATE record.
    base = tmp_path / "schedule" / hour_name(HOUR)
    os.truncate(str(base) + INDEX_SUFFIX, 2 * ENTRY_SIZE)
    os.truncate(str(base) + LOG_SUFFIX, len(ON_TIME) + len(THREE_HOURS_LATE))
    with opened(tmp_path) as storage:
        assert storage.schedule.checkpoint == 0  # back to where a record of the log starts
        replay_until_caught_up(storage.message_log, storage.schedule)
        assert filed(storage.schedule) == before  # the moment it was filed for, not its own


def test_where_a_schedule_says_each_record_is_in_the_log_is_where_filing_finds_it(tmp_path: Path) -> None:
    big = b"x" * 600_000  # two late ones of these do not fit in one LATE record
    asked = {
        "on-time": BASE + 20_000,
        "late-1": BASE + 1,
        "now": 0,
        "late-big-1": BASE + 2,
        "late-big-2": BASE + 3,
        "later": BASE + 30_000,
        "late-2": 1,
    }
    records = [
        encode_message(name, "orders", body=big if "big" in name else b"", deliver_at=at, created_at=BASE)
        for name, at in asked.items()
    ]
    handler = ScheduleHandler(
        current=None, clock=None, limits=None, run_blocking=None, max_unfiled_bytes=0, on_appended=lambda: None
    )  # type: ignore[arg-type]
    data, starts = handler._records(scan_batch(b"".join(records)), range(len(records)), RECEIVED)
    assert handler.rewritten == 5 and starts is not None
    with opened(tmp_path) as storage:
        offset = storage.message_log.append(data)
        storage.message_log.flush()
        replay_until_caught_up(storage.message_log, storage.schedule)
        with storage.schedule.open_hour(HOUR) as reader:
            entries = [reader.entry(n) for n in range(reader.entries)]
            found = {decode_message(r).id: r for r in reader.read_records(list(range(reader.entries)))}
    assert [entry.source for entry in entries] == [offset + start for start in starts]  # what the tail says
    assert [entry.ms_in_hour for entry in entries] == [20_000, 9_000, 9_000, 9_000, 9_000, 30_000, 9_000]
    assert {name: decode_message(record).deliver_at for name, record in found.items()} == {**asked, "now": RECEIVED}
