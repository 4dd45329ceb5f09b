"""restart_at: a closed log emptied to go on at a later offset (its owner lost records it had
consumed, and must never append where they were)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode
from delaymq.storage.errors import OffsetDeleted
from delaymq.storage.log import SegmentedLog, segment_bases
from delaymq.storage.recovery import restart_at
from delaymq.storage.verified import VERIFIED_FILE

RECORD = HEADER_SIZE + 88


def record(i: int) -> bytes:
    return encode(RecordKind.OPAQUE, f"r{i:05d}".encode().ljust(88, b"."))


def write(directory: Path, count: int) -> int:
    """``count`` records in segments of 3 (the verified end saved as it goes); returns the log's end."""
    with SegmentedLog.open(directory, segment_size=3 * RECORD, checkpoint_bytes=RECORD) as log:
        for i in range(count):
            log.append(record(i))
            log.flush()
        return log.end_offset


def test_a_restarted_log_goes_on_at_the_offset_and_answers_below_it_that_it_starts_there(tmp_path: Path) -> None:
    end = write(tmp_path, 10)
    assert (tmp_path / VERIFIED_FILE).exists()
    assert restart_at(tmp_path, end + 5 * RECORD) == end
    assert segment_bases(tmp_path) == [end + 5 * RECORD]
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        assert (log.start_offset, log.end_offset) == (end + 5 * RECORD, end + 5 * RECORD)
        with pytest.raises(OffsetDeleted):
            log.read_raw(end)  # what a slave asking for a lost offset is told
        assert log.append(record(100)) == end + 5 * RECORD
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:  # and it stays so
        assert [r.offset for r in log.iter_from(log.start_offset)] == [end + 5 * RECORD]


def test_it_refuses_an_offset_below_the_end_and_changes_nothing(tmp_path: Path) -> None:
    end = write(tmp_path, 4)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="would drop records"):
        restart_at(tmp_path, end - 1)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_restart_cut_short_by_a_crash_is_done_again(tmp_path: Path) -> None:
    end = write(tmp_path, 7)
    for base in segment_bases(tmp_path):  # killed after deleting every segment, before the new one
        (tmp_path / f"{base:020d}").unlink()
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        assert log.end_offset == 0  # an empty log at 0: its owner restarts it again
    restart_at(tmp_path, end)
    with SegmentedLog.open(tmp_path, segment_size=3 * RECORD) as log:
        assert (log.start_offset, log.end_offset) == (end, end)
