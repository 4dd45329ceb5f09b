"""Replay of the message log into hourly schedule logs, and reading them back."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.protocol.records import decode_message, encode_message
from delaymq.scheduler.delayindex import ENTRY_SIZE, heads_from_index
from delaymq.scheduler.hours import HOUR_MS, HourOutOfRange, ReplayGap, ScheduleError, hour_name
from delaymq.scheduler.idindex import cancel_record, move_record
from delaymq.scheduler.replay import replay_step, replay_until_caught_up
from delaymq.scheduler.schedulefiles import syncfs as _syncfs
from delaymq.scheduler.schedulelog import INDEX_SUFFIX, LOG_SUFFIX, ScheduleStore
from delaymq.storage.errors import FormatMismatch
from delaymq.storage.format import read_format, write_format
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.wheel import SecondWheel

BASE = 1_750_000_000_000 - 1_750_000_000_000 % HOUR_MS  # an hour boundary in 2025
HOUR = BASE // HOUR_MS


def message(i: int, deliver_at: int, *, created_at: int = BASE - 5_000, body: bytes = b"") -> bytes:
    subject = f"subject.{i % 3}"
    return encode_message(f"m{i}", subject, deliver_at=deliver_at, created_at=created_at, body=body)


@pytest.fixture
def scheduler_folder(sched: SimpleNamespace) -> Any:
    """``scheduler_folder(root, **store_options)``: a data folder's message log (1 MiB segments) and store."""
    return partial(sched.folder, segment_size=1 << 20)


def append(log: SegmentedLog, records: list[bytes], batch: int = 100) -> list[int]:
    """Append records in batches; returns each record's message-log offset."""
    offsets = []
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        position = log.append(b"".join(chunk))
        for record in chunk:
            offsets.append(position)
            position += len(record)
    log.flush()
    return offsets


def filed(store: ScheduleStore) -> dict[int, list[tuple[int, int, bytes]]]:
    """Per hour, every entry as (entry_no, ms_in_hour, record), walked through the chains."""
    out: dict[int, list[tuple[int, int, bytes]]] = {}
    for hour in store.hours_with_messages():
        with store.open_hour(hour) as reader:
            heads = reader.heads()
            pairs = [pair for second in heads.seconds() for pair in reader.chain(second)]
            records = reader.read_records([entry_no for _ms, entry_no in pairs])
            out[hour] = sorted((entry_no, ms, record) for (ms, entry_no), record in zip(pairs, records))
    return out


def test_records_are_filed_into_their_hour_and_second_and_chains_walk_back(
    tmp_path: Path, scheduler_folder: Any
) -> None:
    deliver = [BASE + h * HOUR_MS + (i * 7_919) % HOUR_MS for h in range(6) for i in range(300)]
    deliver += [BASE + 12_345] * 50  # many in one millisecond
    records = [message(i, at) for i, at in enumerate(deliver)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records)
        step = replay_until_caught_up(log, store)
        assert step.filed == len(records)
        assert store.checkpoint == log.end_offset
        assert store.hours_with_messages() == [HOUR + h for h in range(6)]
        assert sorted(step.new_hours) == store.hours_with_messages()
        got = filed(store)
        expected: dict[int, list[tuple[int, bytes]]] = {}
        for at, record in zip(deliver, records):
            expected.setdefault(at // HOUR_MS, []).append((at % HOUR_MS, record))
        for hour, entries in got.items():
            # Entry numbers are 0..n-1 in filing order, each with its own record and ms.
            assert [e for e, _, _ in entries] == list(range(len(expected[hour])))
            assert [(ms, rec) for _, ms, rec in entries] == expected[hour]
            with store.open_hour(hour) as reader:
                heads = reader.heads()
                assert heads.entries == reader.entries == len(expected[hour])
                for second in range(3600):
                    chain = reader.chain(second)
                    assert len(chain) == heads.counts[second]
                    assert [e for _, e in chain] == sorted((e for _, e in chain), reverse=True)
                    assert all(second * 1000 <= ms < second * 1000 + 1000 for ms, _ in chain)
                    assert (chain[0][1] if chain else -1) == heads.newest[second]
                # The heads kept in lmdb are exactly what the index alone rebuilds.
                index = store.path_of(hour, INDEX_SUFFIX).read_bytes()
                assert heads_from_index(hour, index) == heads
        assert store.path_of(HOUR, LOG_SUFFIX).name == hour_name(HOUR) + ".log"


def test_100k_messages_in_one_second(tmp_path: Path, scheduler_folder: Any) -> None:
    count = 100_000
    second = 1234
    records = [message(i, BASE + second * 1000 + i % 1000) for i in range(count)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records, batch=5000)
        started = time.perf_counter()
        step = replay_until_caught_up(log, store)
        replayed = time.perf_counter() - started
        assert step.filed == count
        with store.open_hour(HOUR) as reader:
            heads = reader.heads()
            assert heads.counts[second] == count and heads.entries == count
            started = time.perf_counter()
            chain = reader.chain(second)
            walked = time.perf_counter() - started
            assert sorted(chain) == sorted((i % 1000 + second * 1000, i) for i in range(count))
            assert reader.read_records([0, count - 1, 500]) == [records[0], records[-1], records[500]]
            wheel = SecondWheel.from_counts(HOUR, heads.counts)
            wheel.load_second(second, chain)
            due = wheel.pop_due(BASE + HOUR_MS)
            assert len(due) == count and due == sorted(due)
    print(f"\n100k in one second: replay {count / replayed:,.0f} records/s, chain walk {count / walked:,.0f} entries/s")


def test_past_and_immediate_deliver_at(tmp_path: Path, scheduler_folder: Any) -> None:
    past = BASE - 30 * 24 * HOUR_MS + 1_500  # a month ago: its own (past) hour
    created = BASE + 7_000
    records = [message(0, past), message(1, 0, created_at=created), message(2, -5, created_at=created)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records)
        replay_until_caught_up(log, store)
        assert store.hours_with_messages() == [past // HOUR_MS, HOUR]
        got = filed(store)
        assert got[past // HOUR_MS] == [(0, 1_500, records[0])]
        assert got[HOUR] == [(0, 7_000, records[1]), (1, 7_000, records[2])]


def test_a_step_stops_at_the_flushed_offset_and_at_max_bytes(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + i * 1000) for i in range(100)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records[:60])
        log.append(b"".join(records[60:]))  # written, not yet fsynced
        assert log.flushed_offset < log.end_offset
        first = replay_step(log, store, max_bytes=len(records[0]) * 10)
        assert first.filed == 10 and first.checkpoint == store.checkpoint == sum(map(len, records[:10]))
        assert first.arrivals[HOUR].first_entry == 0
        assert first.arrivals[HOUR].pairs() == [(i * 1000, i) for i in range(10)]
        rest = replay_until_caught_up(log, store)
        assert rest.filed == 50 and store.checkpoint == log.flushed_offset
        assert rest.arrivals[HOUR].first_entry == 10 and len(rest.arrivals[HOUR]) == 50
        assert replay_step(log, store).filed == 0  # caught up with what is durable
        log.flush()
        assert replay_step(log, store).filed == 40
        assert store.entries(HOUR) == 100


def test_a_step_touches_at_most_max_step_hours(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + (i % 10) * HOUR_MS) for i in range(100)]
    with scheduler_folder(tmp_path, max_step_hours=3) as (log, store):
        append(log, records)
        steps = []
        while True:
            step = replay_step(log, store)
            if step.checkpoint == step.start_offset:
                break
            assert len(step.arrivals) <= 3
            steps.append(step)
        assert len(steps) > 10
        assert sum(step.filed for step in steps) == 100
        assert [store.entries(HOUR + h) for h in range(10)] == [10] * 10
        stats = store.statistics()
        assert stats.heads_held == 0  # nothing of the heads stays between steps
        assert stats.heads_held_max == 3  # a step: 3 hours, one second each
        assert stats.fsyncs > 0 and stats.syncfs == 0  # few hours a step: one fdatasync per file
        got = filed(store)
        for h in range(10):
            assert [record for _, _, record in got[HOUR + h]] == records[h::10]


def test_a_moved_immediate_record_counts_against_max_step_hours_in_the_hour_it_is_filed_in(
    tmp_path: Path, scheduler_folder: Any
) -> None:
    # A moved record whose deliver_at is 0 is filed at its created_at, as a message is: the
    # step limit is checked against that hour (not hour 0), so it joins the step filing it.
    moved = message(7, 0, created_at=BASE + 5 * HOUR_MS + 1_500)
    records = [message(1, BASE + 5 * HOUR_MS + 2_000), move_record([moved]), message(2, BASE + 2_000)]
    with scheduler_folder(tmp_path, max_step_hours=1) as (log, store):
        append(log, records)
        first = replay_step(log, store)
        assert first.filed == 2 and list(first.arrivals) == [HOUR + 5]
        assert list(first.arrivals[HOUR + 5].ms_in_hour) == [2_000, 1_500]
        second = replay_step(log, store)
        assert second.filed == 1 and list(second.arrivals) == [HOUR]
        assert [record for _, _, record in filed(store)[HOUR + 5]] == [records[0], moved]


@pytest.mark.skipif(_syncfs is None, reason="no syncfs(2) here")
def test_a_step_filing_many_hours_syncs_the_file_system_once(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + i * HOUR_MS) for i in range(40)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records)
        step = replay_step(log, store)
        assert step.filed == 40 and len(step.arrivals) == 40
        stats = store.statistics()
        assert (stats.syncfs, stats.fsyncs) == (1, 0)


def test_records_of_other_kinds_are_skipped(tmp_path: Path, scheduler_folder: Any) -> None:
    with scheduler_folder(tmp_path) as (log, store):
        log.append(encode(RecordKind.STATE, b"not a message") + message(1, BASE + 5))
        log.flush()
        step = replay_until_caught_up(log, store)
        assert (step.filed, step.skipped) == (1, 1)
        assert store.checkpoint == log.end_offset


def test_reading_records_decodes_and_checks(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + 60_000, body=bytes([i]) * (i * 300)) for i in range(40)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records, batch=7)
        replay_until_caught_up(log, store)
        with store.open_hour(HOUR) as reader:
            wanted = [39, 0, 17, 17, 5]
            assert reader.read_records(wanted) == [records[i] for i in wanted]
            assert decode_message(reader.read_records([3])[0]).body == bytes([3]) * 900
            entry = reader.entry(3)
            assert (entry.size, entry.ms_in_hour, entry.prev) == (len(records[3]), 60_000, 2)
            with pytest.raises(ScheduleError, match="entry_no 40 is outside 0..39"):
                reader.read_records([40])
            with pytest.raises(ScheduleError, match="second=3600"):
                reader.chain(3600)
            # A flipped byte in the schedule log is caught, naming the entry.
            path = store.path_of(HOUR, LOG_SUFFIX)
            with open(path, "r+b") as f:
                f.seek(entry.offset + 30)
                byte = f.read(1)
                f.seek(entry.offset + 30)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises(ScheduleError, match="entry 3's record .* fails its CRC"):
                reader.read_records([3])


def test_records_still_in_the_message_logs_memory_are_read_from_there_and_the_rest_from_the_file(
    tmp_path: Path, scheduler_folder: Any
) -> None:
    """What is due within seconds of its arrival is loaded from the message log's recent bytes
    (no read, no second CRC); what it forgot, or bytes that are not the record, from the file."""
    records = [message(i, BASE + 60_000, body=bytes([i]) * 200) for i in range(20)]
    with scheduler_folder(tmp_path) as (log, store):
        log.keep_recent(1 << 20)
        store.recent_source = log.read_recent_many
        append(log, records, batch=7)
        replay_until_caught_up(log, store)
        with store.open_hour(HOUR) as reader:
            entry = reader.entry(3)
            path = store.path_of(HOUR, LOG_SUFFIX)
            with open(path, "r+b") as f:  # the schedule log's copy is damaged
                f.seek(entry.offset + 30)
                byte = f.read(1)
                f.seek(entry.offset + 30)
                f.write(bytes([byte[0] ^ 0xFF]))
            assert reader.read_records([3, 19, 0]) == [records[3], records[19], records[0]]  # from memory
            store.recent_source = lambda spans: [bytes(size) for _source, size in spans]  # not records: the file
            assert reader.read_records([19]) == [records[19]]
            with pytest.raises(ScheduleError, match="entry 3's record .* fails its CRC"):
                reader.read_records([3])
            store.recent_source = log.read_recent_many
            log.keep_recent(1)
            log.append(message(99, BASE + HOUR_MS))  # the log keeps only this batch now
            with pytest.raises(ScheduleError, match="entry 3's record .* fails its CRC"):
                reader.read_records([3])


@pytest.mark.parametrize("recent", [True, False], ids=["from memory", "from the file"])
def test_a_step_files_at_most_max_bytes_but_always_one_batch(
    tmp_path: Path, scheduler_folder: Any, recent: bool
) -> None:
    """A step's memory is bounded by ``max_bytes``: a batch that would take it past them is
    the next step's; a batch bigger than ``max_bytes`` is a step of its own (it moves on)."""
    records = [message(i, BASE + 60_000 + i, body=b"x" * 100) for i in range(40)]
    size = len(records[0])
    with scheduler_folder(tmp_path) as (log, store):
        if recent:
            log.keep_recent(1 << 20)
        append(log, records, batch=10)
        steps = []
        while not (step := replay_step(log, store, max_bytes=int(15.5 * size))).idle:
            steps.append(step.filed)
        # Memory hands whole batches (two would be 20 records, past 15.5); the file, records.
        assert steps == ([10, 10, 10, 10] if recent else [15, 15, 10])
        assert sum(len(v) for v in filed(store).values()) == 40

        append(log, [message(100 + i, BASE + 90_000, body=b"y" * 100) for i in range(10)], batch=10)
        step = replay_step(log, store, max_bytes=size)  # smaller than the batch
        assert step.filed == (10 if recent else 1)


def test_chain_below_and_floor(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + 3_000 + i) for i in range(10)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records)
        replay_until_caught_up(log, store)
        with store.open_hour(HOUR) as reader:
            assert [e for _, e in reader.chain(3)] == list(range(9, -1, -1))
            assert [e for _, e in reader.chain(3, below=6)] == [5, 4, 3, 2, 1, 0]
            assert [e for _, e in reader.chain(3, floor=7)] == [9, 8, 7]
            assert reader.chain(4) == []


def test_deliver_at_past_year_9999_is_refused_naming_the_limit(tmp_path: Path, scheduler_folder: Any) -> None:
    with scheduler_folder(tmp_path) as (log, store):
        append(log, [message(0, BASE), message(1, 253_402_300_800_000)])  # 10000-01-01
        with pytest.raises(HourOutOfRange, match="deliver_at 253402300800000 is beyond 253402300799999"):
            replay_step(log, store)
        assert store.checkpoint == 0 and store.hours_with_messages() == []


def test_checkpoint_allows_deleting_replayed_segments(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + i, body=b"x" * 20_000) for i in range(200)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records, batch=10)
        assert len(log.segments()) > 2
        replay_step(log, store, max_bytes=1 << 20)
        checkpoint = store.checkpoint
        assert 0 < checkpoint < log.end_offset
        assert log.delete_before(checkpoint) >= 1
        assert log.start_offset <= checkpoint
        replay_until_caught_up(log, store)
        assert store.entries(HOUR) == 200
        log.delete_before(store.checkpoint)
    # Reopened with segments gone, the schedule logs still hold every record.
    with scheduler_folder(tmp_path) as (log, store):
        assert [record for _, _, record in filed(store)[HOUR]] == records


def test_replay_refuses_a_gap_in_the_message_log(tmp_path: Path, scheduler_folder: Any) -> None:
    records = [message(i, BASE + i, body=b"x" * 20_000) for i in range(200)]
    with scheduler_folder(tmp_path) as (log, store):
        append(log, records, batch=10)
        log.delete_before(log.end_offset)  # deleted before being replayed
        with pytest.raises(ReplayGap, match="before the message log's first offset"):
            replay_step(log, store)


def test_format_parameters_are_kept_and_refused_if_different(tmp_path: Path, scheduler_folder: Any) -> None:
    with scheduler_folder(tmp_path) as (log, store):
        append(log, [message(0, BASE)])
        replay_until_caught_up(log, store)
    stored = read_format(tmp_path / "schedule")
    assert stored is not None and stored["index_entry_size"] == ENTRY_SIZE
    write_format(tmp_path / "schedule", {**stored, "index_entry_size": 24})
    state = StateStore.open(tmp_path / "state")
    try:
        with pytest.raises(FormatMismatch, match="index_entry_size: stored 24, requested 32"):
            ScheduleStore.open(tmp_path / "schedule", state)
    finally:
        state.close()


def test_files_are_named_by_utc_hour(tmp_path: Path, scheduler_folder: Any) -> None:
    at = 1_735_689_600_000 + 5 * HOUR_MS  # 2025-01-01 05:00 UTC
    with scheduler_folder(tmp_path) as (log, store):
        append(log, [message(0, at + 59_999)])
        replay_until_caught_up(log, store)
        names = sorted(os.listdir(tmp_path / "schedule"))
        assert names == ["2025010105.heads", "2025010105.index", "2025010105.log", "FORMAT"]


def test_replay_files_what_was_just_appended_from_memory_as_it_would_from_the_disk(
    tmp_path: Path, scheduler_folder: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's log keeps its newest appends in memory (``keep_recent``): replay files
    them from there, with no read, and exactly as from the disk; never past what is flushed."""
    deliver = [BASE + h * HOUR_MS + (i * 7_919) % HOUR_MS for h in range(3) for i in range(200)]
    records = [message(i, at) for i, at in enumerate(deliver)]
    results = []
    for name, held in (("disk", False), ("memory", True)):
        with scheduler_folder(tmp_path / name) as (log, store):
            if held:
                log.keep_recent(1 << 20)
            reads: list[int] = []
            original = SegmentedLog.read_raw

            def counted(self: SegmentedLog, *args: Any, reads: list[int] = reads, original: Any = original) -> Any:
                reads.append(1)
                return original(self, *args)

            monkeypatch.setattr(SegmentedLog, "read_raw", counted)
            append(log, records[:500])
            log.append(b"".join(records[500:]))  # written, not yet fsynced: not filed yet
            step = replay_until_caught_up(log, store, max_bytes=len(records[0]) * 150)
            assert step.filed == 500 and store.checkpoint == log.flushed_offset < log.end_offset
            log.flush()
            assert replay_until_caught_up(log, store).filed == 100
            results.append((filed(store), store.checkpoint, bool(reads)))
            monkeypatch.undo()
    (from_disk, disk_checkpoint, disk_read), (from_memory, memory_checkpoint, memory_read) = results
    assert from_memory == from_disk and memory_checkpoint == disk_checkpoint
    assert disk_read and not memory_read  # held in memory: no read of the log at all


@pytest.mark.parametrize("cut", ["message", "cancel"])
def test_staging_refuses_a_record_cut_by_stop_naming_where_it_ends(
    tmp_path: Path, scheduler_folder: Any, cut: str
) -> None:
    # A record ending past what was given to stage (a message, or a CANCEL after filed
    # messages) is refused with both offsets, and the step is dropped: nothing filed.
    whole = message(1, BASE + 2_000)
    last = message(2, BASE + 3_000) if cut == "message" else cancel_record(["m1"])
    buf = whole + last
    stop = len(buf) - 5
    with scheduler_folder(tmp_path) as (_log, store):
        with pytest.raises(
            ScheduleError, match=rf"offset {1_000 + len(whole)} ends at {1_000 + len(buf)}, past .*\({1_000 + stop}\)"
        ):
            store.stage(buf, 1_000, stop)
        assert filed(store) == {} and store.checkpoint == 0
