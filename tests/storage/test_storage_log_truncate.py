"""SegmentedLog.truncate: a replica cuts the tail its master never had (docs/replication.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.storage.errors import NotRecordStart, OffsetBeyondEnd, OffsetDeleted
from delaymq.storage.log import SegmentedLog

RECORD = HEADER_SIZE + 88  # every record below is this long


def records(start: int, count: int) -> list[bytes]:
    return [encode(RecordKind.OPAQUE, f"r{i:05d}".encode().ljust(88, b".")) for i in range(start, start + count)]


def segment_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.isdigit())


def test_truncate_cuts_back_across_segments_durably_and_appends_go_on_from_there(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        for record in records(0, 30):  # 10 segments of 3 records each
            log.append(record)
        assert len(segment_files(tmp_path)) == 10
        cut = log.truncate(7 * RECORD)
        assert cut == 23 * RECORD
        assert (log.end_offset, log.flushed_offset) == (7 * RECORD, 7 * RECORD)
        assert len(segment_files(tmp_path)) == 3  # segments wholly past the cut are gone
        log.append(records(100, 1)[0])
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:  # what a restart finds
        assert log.end_offset == 8 * RECORD
        got = [bytes(r.payload[:6]) for r in log.iter_from(0)]
        assert got == [f"r{i:05d}".encode() for i in (*range(7), 100)]


def test_truncate_at_a_segment_start_keeps_the_previous_segment_active(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        for record in records(0, 9):
            log.append(record)
        bases = [base for base, _size in log.segments()]
        log.truncate(bases[1])
        assert log.segments() == [(0, bases[1])]
        assert log.end_offset == bases[1]


def test_truncate_refuses_offsets_that_are_not_record_starts_and_changes_nothing(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        for record in records(0, 12):
            log.append(record)
        end = log.end_offset
        with pytest.raises(NotRecordStart):
            log.truncate(RECORD + 5)
        with pytest.raises(OffsetBeyondEnd):
            log.truncate(end + RECORD)
        assert log.truncate(end) == 0
        log.delete_before(6 * RECORD)
        with pytest.raises(OffsetDeleted):
            log.truncate(0)
        assert log.end_offset == end
        assert len(list(log.iter_from(log.start_offset))) == 12 - log.start_offset // RECORD
