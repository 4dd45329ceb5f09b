"""SegmentedLog recovery: damage written into segment files with plain file I/O, then reopen."""

from __future__ import annotations

import logging
import os
import resource
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from delaymq.protocol.envelope import HEADER_SIZE, MAGIC, VERSION, RecordKind, encode
from delaymq.storage.errors import CorruptLog, LogIOError
from delaymq.storage.log import SegmentedLog

SEGMENT_SIZE = 1000


def payload(i: int) -> bytes:
    return f"payload-{i:05d}-".encode().ljust(60, b"~")


def build_log(directory: Path, count: int = 40) -> list[int]:
    """A closed log of ``count`` records over several segments; returns their offsets."""
    with SegmentedLog.open(directory, segment_size=SEGMENT_SIZE) as log:
        return [log.append_record(RecordKind.MESSAGE, payload(i)) for i in range(count)]


def last_segment(directory: Path) -> Path:
    return max(p for p in directory.iterdir() if p.name.isdigit())


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as file:
        file.write(data)


def flip_byte(path: Path, position_from_end: int) -> None:
    with open(path, "r+b") as file:
        file.seek(-position_from_end, os.SEEK_END)
        byte = file.read(1)
        file.seek(-position_from_end, os.SEEK_END)
        file.write(bytes([byte[0] ^ 0x5A]))


RECORD = HEADER_SIZE + 60

# Each damage: (how to damage the last segment, how many intact records remain, why).
DAMAGE: dict[str, tuple[Callable[[Path], None], int, str]] = {
    "half-written record": (
        lambda p: append_bytes(p, encode(RecordKind.MESSAGE, payload(99))[:40]),
        40,
        "truncated record payload",
    ),
    "half-written header": (
        lambda p: append_bytes(p, encode(RecordKind.MESSAGE, payload(99))[:7]),
        40,
        "truncated record header",
    ),
    "flipped payload byte": (lambda p: flip_byte(p, 10), 39, "bad record CRC"),
    "flipped size byte": (lambda p: flip_byte(p, RECORD - 3), 39, ""),
    "zero garbage": (lambda p: append_bytes(p, bytes(64)), 40, "bad record magic 0x00"),
    "header with bad crc": (
        lambda p: append_bytes(p, bytes([0, 0, 0, 4, MAGIC, VERSION, 0, 1, 9, 9, 9, 9]) + b"junk"),
        40,
        "bad record CRC",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_reopen_cuts_a_damaged_tail_and_keeps_every_record_before_it(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    offsets = build_log(tmp_path)
    segment = last_segment(tmp_path)
    damage_segment, intact, reason = DAMAGE[damage]
    damage_segment(segment)

    with caplog.at_level(logging.WARNING, logger="delaymq.storage.log"):
        log = SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE)
    with log:
        cut_at = offsets[intact] if intact < len(offsets) else offsets[-1] + RECORD
        assert log.end_offset == cut_at
        assert [(r.offset, r.payload) for r in log.iter_from(0)] == [(offsets[i], payload(i)) for i in range(intact)]
        (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert segment.name in warning.getMessage()
        assert f"from offset {cut_at}" in warning.getMessage()
        assert reason in warning.getMessage()
        # Appends carry on right where the intact records stop.
        assert log.append_record(RecordKind.MESSAGE, b"after recovery") == cut_at
    with SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE) as log:
        records = list(log.iter_from(0))
        assert [r.payload for r in records] == [*(payload(i) for i in range(intact)), b"after recovery"]
        assert log.end_offset == records[-1].next_offset


def test_a_last_segment_holding_only_garbage_is_removed(tmp_path: Path) -> None:
    offsets = build_log(tmp_path)
    previous_end = offsets[-1] + RECORD
    garbage = tmp_path / f"{previous_end:020d}"
    garbage.write_bytes(b"\xff" * 30)
    with SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE) as log:
        assert not garbage.exists()
        assert log.end_offset == previous_end
        assert [r.offset for r in log.iter_from(0)] == offsets
        assert log.append_record(RecordKind.MESSAGE, b"next") == previous_end


def test_a_lone_segment_cut_to_nothing_keeps_its_first_offset(tmp_path: Path) -> None:
    offsets = build_log(tmp_path)
    with SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE) as log:
        log.delete_before(log.end_offset)
        ((base, _size),) = log.segments()
    segment = tmp_path / f"{base:020d}"
    with open(segment, "r+b") as file:
        file.write(b"\xff")  # the only segment's first record no longer checks
    with SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE) as log:
        assert log.segments() == [(base, 0)]
        assert (log.start_offset, log.end_offset) == (base, base)
        assert log.append_record(RecordKind.MESSAGE, b"again") == base
    assert base > offsets[0]


def test_a_gap_between_segments_is_refused_not_guessed_at(tmp_path: Path) -> None:
    build_log(tmp_path)
    middle = sorted(p for p in tmp_path.iterdir() if p.name.isdigit())[1]
    os.truncate(middle, middle.stat().st_size - 10)
    with pytest.raises(CorruptLog, match=rf"segment {middle.name} ends at offset \d+ but the next"):
        SegmentedLog.open(tmp_path, segment_size=SEGMENT_SIZE)


def test_a_failed_write_is_cut_back_and_the_log_carries_on(tmp_path: Path) -> None:
    with SegmentedLog.open(tmp_path, segment_size=1 << 20) as log:
        first = log.append_record(RecordKind.MESSAGE, payload(0))
        batch = b"".join(encode(RecordKind.MESSAGE, payload(i)) for i in range(1, 50))
        # A real short write: the file size limit stops the write part way.
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
        try:
            with pytest.raises(LogIOError, match=rf"append of {len(batch)} bytes at offset {RECORD}"):
                log.append(batch)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, previous_handler)
        assert log.end_offset == RECORD
        assert (tmp_path / f"{0:020d}").stat().st_size == RECORD
        assert log.append(batch) == RECORD
        log.flush()
    with SegmentedLog.open(tmp_path, segment_size=1 << 20) as log:
        assert [r.payload for r in log.iter_from(first)] == [payload(i) for i in range(50)]
