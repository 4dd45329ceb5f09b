"""The pure parts: hour names, index entries, heads rebuilt from an index, entry checks."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.scheduler.delayindex import (
    ENTRY_SIZE,
    EntryChecker,
    empty_heads,
    heads_from_index,
    pack_entry,
    read_entry,
    record_problem,
)
from delaymq.scheduler.hours import (
    HOUR_MS,
    MAX_DELIVER_AT,
    MAX_HOUR,
    CorruptSchedule,
    HourOutOfRange,
    hour_name,
    parse_hour_name,
)
from delaymq.wheel import hour_of


@given(st.integers(0, MAX_DELIVER_AT))
def test_hour_names_are_utc_and_round_trip(at: int) -> None:
    hour = hour_of(at)
    name = hour_name(hour)
    moment = datetime.fromtimestamp(at / 1000, UTC)
    assert name == moment.strftime("%Y%m%d%H")
    assert parse_hour_name(name) == hour


def test_hour_name_limits() -> None:
    assert hour_name(0) == "1970010100"
    assert hour_name(MAX_HOUR) == "9999123123"
    assert MAX_DELIVER_AT == (MAX_HOUR + 1) * HOUR_MS - 1
    with pytest.raises(HourOutOfRange, match="hour=70389528: must be an int from 0 to 70389527"):
        hour_name(MAX_HOUR + 1)
    with pytest.raises(HourOutOfRange):
        hour_name(-1)
    with pytest.raises(ValueError, match="not YYYYMMDDHH"):
        parse_hour_name("2025-01-01")
    with pytest.raises(ValueError):
        parse_hour_name("2025023012")  # 30 February


def entries(*ms_values: int, record_size: int = 20) -> bytes:
    """An index of entries with these ms values, linked as filing links them."""
    newest: dict[int, int] = {}
    out = b""
    for n, ms in enumerate(ms_values):
        prev = newest.get(ms // 1000, -1)
        out += pack_entry(n * record_size, record_size, ms, prev, 1000 + n * record_size)
        newest[ms // 1000] = n
    return out


def test_entry_layout_and_crc() -> None:
    data = pack_entry(0x0102030405060708, 99, 3_599_999, -1, 77)
    assert len(data) == ENTRY_SIZE == 32
    assert data[:8] == bytes.fromhex("0102030405060708")
    assert data[16:20] == b"\xff\xff\xff\xff"
    assert read_entry(data, 0, 0, "x") == (0x0102030405060708, 99, 3_599_999, -1, 77)
    flipped = data[:5] + bytes([data[5] ^ 4]) + data[6:]
    with pytest.raises(CorruptSchedule, match="x: entry 9 fails its CRC"):
        read_entry(flipped, 0, 9, "x")


def test_heads_from_index() -> None:
    heads = heads_from_index(5, entries(1500, 1999, 7, 1000, 3_599_999))
    assert heads.entries == 5
    assert (heads.newest[1], heads.counts[1]) == (3, 3)
    assert (heads.newest[0], heads.counts[0]) == (2, 1)
    assert (heads.newest[3599], heads.counts[3599]) == (4, 1)
    assert heads.seconds() == [0, 1, 3599]
    assert sum(heads.counts) == 5 and heads.newest.count(-1) == 3597


def test_heads_from_index_refuses_a_broken_chain() -> None:
    index = entries(1500, 1999) + pack_entry(40, 20, 1200, 0, 2000)  # prev should be 1
    with pytest.raises(CorruptSchedule, match="entry 2 links to 0, but second 1's newest entry is 1"):
        heads_from_index(0, index)
    with pytest.raises(CorruptSchedule, match="not a whole number"):
        heads_from_index(0, entries(1) + b"\x00")


def test_entry_checker_takes_the_valid_prefix() -> None:
    record = encode(RecordKind.MESSAGE, b"x" * 8)
    log = record * 3
    size = len(record)
    index = b"".join(pack_entry(i * size, size, 5, i - 1, 100 + i * size) for i in range(3))
    checker = EntryChecker(*empty_heads())
    for i in range(3):
        entry = checker.check(index, i * ENTRY_SIZE, len(log))
        assert entry is not None and record_problem(log, entry.offset, entry.size) == ""
        checker.take(entry)
    assert (checker.entries, checker.log_end, checker.first_source) == (3, len(log), 100)
    assert checker.next_source == 100 + 3 * len(record)
    assert checker.newest[0] == 2 and checker.counts[0] == 3
    # An entry whose record lies past the log's end is not taken.
    extra = pack_entry(len(log), len(record), 5, 2, 200)
    assert checker.check(extra, 0, len(log)) is None
    assert "not within the log" in checker.problem
    # One that links wrongly is not taken either.
    assert checker.check(pack_entry(len(log), len(record), 5, 1, 200), 0, len(log) * 2) is None
    assert "links to 1" in checker.problem
    assert record_problem(log[:-1], 2 * size, size) == f"record of {size} bytes is cut short"
