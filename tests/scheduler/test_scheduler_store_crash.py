"""Crash safety of replay: killed mid-step, torn tails, damaged files, repairs."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from delaymq.protocol.records import encode_message
from delaymq.scheduler.delayindex import CHECKPOINT_KEY, ENTRY_SIZE, REPLAY_DB, heads_from_index
from delaymq.scheduler.headstable import HeadsTables
from delaymq.scheduler.hours import HOUR_MS, CorruptSchedule, ReplayGap, ScheduleError, hour_name
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.scheduler.schedulelog import HEADS_SUFFIX, INDEX_SUFFIX, LOG_SUFFIX, ScheduleStore
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS
HOUR = BASE // HOUR_MS
HOURS = 4
SEGMENT_SIZE = 4096


def make_records(count: int) -> list[bytes]:
    """Messages spread over ``HOURS`` hours, interleaved, several per second."""
    return [
        encode_message(
            f"m{i}",
            "orders",
            deliver_at=BASE + (i % HOURS) * HOUR_MS + (i * 997) % 20_000,
            created_at=BASE,
            body=b"b" * (i % 50),
        )
        for i in range(count)
    ]


@pytest.fixture
def opened(sched: SimpleNamespace) -> Any:
    """``opened(root)``: the message log (in ``SEGMENT_SIZE`` segments) and schedule store of a data folder."""
    return partial(sched.folder, segment_size=SEGMENT_SIZE)


def write_message_log(root: Path, records: list[bytes]) -> list[bytes]:
    """Append ``records`` to the message log in ``root`` (batches of 50); returns them."""
    with SegmentedLog.open(root / "messages", segment_size=SEGMENT_SIZE) as log:
        for i in range(0, len(records), 50):
            log.append(b"".join(records[i : i + 50]))
    return records


def record_ends(records: list[bytes]) -> list[int]:
    ends, position = [], 0
    for record in records:
        position += len(record)
        ends.append(position)
    return ends


def assert_filed_exactly_once(store: ScheduleStore, records: list[bytes]) -> None:
    """Every record is in its hour once, entries numbered 0..n-1 in message-log order,
    and every second's chain holds exactly its entries."""
    expected: dict[int, list[bytes]] = {}
    for i, record in enumerate(records):
        expected.setdefault(HOUR + i % HOURS, []).append(record)
    assert store.hours_with_messages() == sorted(expected)
    for hour, wanted in expected.items():
        with store.open_hour(hour) as reader:
            assert reader.entries == len(wanted)
            heads = reader.heads()
            assert heads.entries == len(wanted)
            walked = sorted(e for second in heads.seconds() for _, e in reader.chain(second))
            assert walked == list(range(len(wanted)))
            assert reader.read_records(range(len(wanted))) == wanted  # type: ignore[arg-type]


CHILD = """
import os, sys
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.replay import replay_step

root, crash_on, segment_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
log = SegmentedLog.open(root + "/messages", segment_size=segment_size)
state = StateStore.open(root + "/state")
store = ScheduleStore.open(root + "/schedule", state)
real_write = StateStore.write
calls = 0

def write(self):
    global calls
    calls += 1
    if calls == crash_on:
        os._exit(17)  # killed after the schedule files are written and fsynced
    return real_write(self)

StateStore.write = write
while True:
    step = replay_step(log, store, max_bytes=20_000)
    if step.checkpoint == step.start_offset:
        break
"""


def crash_replay(root: Path, crash_on_commit: int) -> None:
    """Replay in a child process that dies at its ``crash_on_commit``-th lmdb commit."""
    result = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(root), str(crash_on_commit), str(SEGMENT_SIZE)],
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 17, result.stderr.decode()


def test_killed_after_writing_schedule_files_before_the_checkpoint(tmp_path: Path, opened: Any) -> None:
    records = write_message_log(tmp_path, make_records(2_000))
    crash_replay(tmp_path, crash_on_commit=4)
    with opened(tmp_path) as (log, store):
        # Three steps were committed; the fourth wrote its files and died.
        assert 0 < store.checkpoint < log.end_offset
        committed = sum(1 for end in record_ends(records) if end <= store.checkpoint)
        kept = sum(store.entries(HOUR + h) for h in range(HOURS))
        assert kept > committed  # open kept the valid entries of the step that died...
        step = replay_until_caught_up(log, store)
        assert step.already_filed == kept - committed  # ...and replay did not file them again
        assert step.filed + step.already_filed == len(records) - committed
        assert_filed_exactly_once(store, records)


@pytest.mark.parametrize("cut", ["index", "log", "both"])
def test_killed_then_torn_tails_are_cut_and_refiled(tmp_path: Path, opened: Any, cut: str) -> None:
    records = write_message_log(tmp_path, make_records(2_000))
    crash_replay(tmp_path, crash_on_commit=3)
    schedule = tmp_path / "schedule"
    # A torn write: the newest index entry of one hour cut mid-entry, the last record
    # of another hour's schedule log cut mid-record (real bytes, not zeros).
    index = schedule / (sorted(os.listdir(schedule))[0].split(".")[0] + INDEX_SUFFIX)
    logfile = sorted(schedule.glob("*" + LOG_SUFFIX))[-1]
    if cut in ("index", "both"):
        os.truncate(index, index.stat().st_size - 13)
    if cut in ("log", "both"):
        os.truncate(logfile, logfile.stat().st_size - 7)
    with opened(tmp_path) as (log, store):
        assert store.statistics().recovered_hours >= 1
        step = replay_until_caught_up(log, store)
        assert step.filed > 0
        assert_filed_exactly_once(store, records)


def test_damage_below_the_checkpoint_is_refiled_with_the_same_entry_numbers(tmp_path: Path, opened: Any) -> None:
    records = write_message_log(tmp_path, make_records(3_000))
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        checkpoint = store.checkpoint
        store.record_dispatched(HOUR + 1, range(100))
    schedule = tmp_path / "schedule"
    before = {p.name: p.read_bytes() for p in sorted(schedule.iterdir())}
    hour1_index = schedule / [n for n in sorted(before) if n.endswith(INDEX_SUFFIX)][1]
    hour2_log = schedule / [n for n in sorted(before) if n.endswith(LOG_SUFFIX)][2]
    os.truncate(hour1_index, 200 * ENTRY_SIZE + 9)  # mid-entry, far below the checkpoint
    os.truncate(hour2_log, hour2_log.stat().st_size // 2)  # mid-record
    with opened(tmp_path) as (log, store):
        assert store.entries(HOUR + 1) == 200
        assert store.checkpoint < checkpoint  # replay goes back for the lost entries
        step = replay_until_caught_up(log, store)
        assert store.checkpoint == checkpoint
        kept2 = step.arrivals[HOUR + 2].first_entry
        assert 0 < kept2 < 750
        assert step.filed == (750 - 200) + (750 - kept2)
        assert_filed_exactly_once(store, records)
        # Same entry numbers as before the damage, so the dispatch log still holds.
        assert store.delivered(HOUR + 1) == set(range(100))
    after = {p.name: p.read_bytes() for p in sorted(schedule.iterdir())}
    assert after == before


def test_damage_whose_records_were_deleted_from_the_message_log_is_refused(tmp_path: Path, opened: Any) -> None:
    records = make_records(400)
    with SegmentedLog.open(tmp_path / "messages", segment_size=SEGMENT_SIZE) as log:
        for record in records:
            log.append(record)
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        log.delete_before(store.checkpoint)
    index = tmp_path / "schedule" / (hour_name(HOUR) + INDEX_SUFFIX)
    os.truncate(index, 10 * ENTRY_SIZE)
    with opened(tmp_path) as (log, store):
        with pytest.raises(ReplayGap, match="before the message log's first offset"):
            replay_step(log, store)


def test_an_uncommitted_new_hour_with_nothing_valid_is_removed(tmp_path: Path, opened: Any) -> None:
    records = write_message_log(tmp_path, make_records(8))
    crash_replay(tmp_path, crash_on_commit=1)
    schedule = tmp_path / "schedule"
    for index in schedule.glob("*" + INDEX_SUFFIX):
        os.truncate(index, 20)  # not one whole entry
    with opened(tmp_path) as (log, store):
        assert store.hours_with_messages() == [] and store.checkpoint == 0
        assert sorted(os.listdir(schedule)) == ["FORMAT"]
        replay_until_caught_up(log, store)
        assert_filed_exactly_once(store, records)


class Crash(BaseException):
    """The process dies here: nothing below catches it, nothing is cleaned up."""


def test_in_process_crash_between_file_writes_and_commit(
    tmp_path: Path, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = write_message_log(tmp_path, make_records(500))
    with opened(tmp_path) as (log, store):
        replay_step(log, store, max_bytes=10_000)
        monkeypatch.setattr(StateStore, "write", lambda self: (_ for _ in ()).throw(Crash()))
        # A dead process cleans nothing up.
        monkeypatch.setattr(ScheduleStore, "_abort", lambda self: self._clear_step())
        with pytest.raises(Crash):
            replay_step(log, store, max_bytes=30_000)
        monkeypatch.undo()
    with opened(tmp_path) as (log, store):
        assert store.statistics().recovered_hours >= 1  # entries beyond the checkpoint, kept
        replay_until_caught_up(log, store)
        assert_filed_exactly_once(store, records)


def table_heads_agree_with_index(store: ScheduleStore, hour: int) -> bool:
    index = store.path_of(hour, INDEX_SUFFIX).read_bytes()[: store.entries(hour) * ENTRY_SIZE]
    return store.heads(hour) == heads_from_index(hour, index)


def test_killed_while_writing_heads_tables_the_journal_is_written_again(
    tmp_path: Path, opened: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = write_message_log(tmp_path, make_records(2_000))

    real_write = HeadsTables.write

    def write_half_then_die(self: HeadsTables, slots: dict[int, int]) -> None:
        keys = sorted(slots)
        real_write(self, {key: slots[key] for key in keys[::2]})  # some slots of every hour
        raise Crash()

    with opened(tmp_path) as (log, store):
        replay_step(log, store, max_bytes=20_000)
        monkeypatch.setattr(HeadsTables, "write", write_half_then_die)
        with pytest.raises(Crash):
            replay_step(log, store, max_bytes=20_000)
        monkeypatch.undo()
        committed = store.state.get(REPLAY_DB, CHECKPOINT_KEY)
        assert committed is not None
        stale = [hour for hour in store.hours_with_messages() if not table_heads_agree_with_index(store, hour)]
        assert stale  # the tables are behind what lmdb committed
    with opened(tmp_path) as (log, store):
        assert store.checkpoint == int.from_bytes(committed, "big")  # the step was committed
        assert all(table_heads_agree_with_index(store, hour) for hour in store.hours_with_messages())
        replay_until_caught_up(log, store)
        assert_filed_exactly_once(store, records)


def test_a_missing_or_cut_heads_table_is_rebuilt_from_the_index_on_open(tmp_path: Path, opened: Any) -> None:
    records = write_message_log(tmp_path, make_records(400))
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        good = {hour: store.heads(hour) for hour in store.hours_with_messages()}
    os.unlink(tmp_path / "schedule" / (hour_name(HOUR) + HEADS_SUFFIX))
    os.truncate(tmp_path / "schedule" / (hour_name(HOUR + 1) + HEADS_SUFFIX), 100)
    stray = tmp_path / "schedule" / (hour_name(HOUR + 100) + HEADS_SUFFIX)
    stray.write_bytes(bytes(8))  # a table of an hour without entries
    with opened(tmp_path) as (log, store):
        assert store.statistics().recovered_hours == 2
        assert {hour: store.heads(hour) for hour in store.hours_with_messages()} == good
        assert not stray.exists()
        assert replay_until_caught_up(log, store).filed == 0
        assert_filed_exactly_once(store, records)


def lose_slot(store: ScheduleStore, hour: int, second: int) -> None:
    """Zero one slot of the hour's heads table, as a damaged file would."""
    with open(store.path_of(hour, HEADS_SUFFIX), "r+b") as table:
        table.seek(8 * second)
        table.write(bytes(8))


def test_rebuild_heads_repairs_lost_heads(tmp_path: Path, opened: Any) -> None:
    records = write_message_log(tmp_path, make_records(400))
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        good = store.heads(HOUR)
        second = good.seconds()[0]
        lose_slot(store, HOUR, second)
        assert store.heads(HOUR) != good
        assert store.rebuild_heads(HOUR) == good
        assert store.heads(HOUR) == good
    # Lost heads found when the hour is next filed into: refused, naming the repair.
    with opened(tmp_path) as (log, store):
        lose_slot(store, HOUR, second)
        with SegmentedLog.open(tmp_path / "more") as other:
            other.append(records[0])
            with pytest.raises(CorruptSchedule, match=r"run rebuild_heads"):
                store.stage(other.read_raw(0)[0], store.checkpoint + 10**9)
        store.rebuild_heads(HOUR)
        assert store.heads(HOUR) == good


def test_a_failed_fsync_stops_filing_until_reopen(tmp_path: Path, opened: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    records = write_message_log(tmp_path, make_records(40))
    with opened(tmp_path) as (log, store):

        def broken(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", broken)
        with pytest.raises(ScheduleError, match="replay commit at checkpoint .* Input/output error"):
            replay_step(log, store, max_bytes=500)
        monkeypatch.undo()
        assert store.checkpoint == 0 and store.hours_with_messages() == []
        with pytest.raises(ScheduleError, match="refuses filing after an earlier failure"):
            replay_step(log, store)
    with opened(tmp_path) as (log, store):
        replay_until_caught_up(log, store)
        assert_filed_exactly_once(store, records)
