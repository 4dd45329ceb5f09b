"""The delay index and second-heads table of one hour: fixed-size entries, linked per second.

An hour's delay index (``YYYYMMDDHH.index``) is an array of 32-byte entries, entry
number ``n`` at byte ``32 * n``, appended in filing order. Big-endian::

    offset size  field
    0      8     offset      u64  where the record starts in the hour's schedule log
    8      4     size        u32  the whole record's length (envelope header + payload)
    12     4     ms_in_hour  u32  its delivery millisecond within the hour, 0..3,599,999
    16     4     prev        i32  previous entry number of the same second, -1 for none
    20     8     source      u64  message-log offset the record was replayed from
    28     4     crc         u32  CRC-32 of bytes 0..28

The second-heads table holds, for each of the hour's 3,600 seconds, the newest entry
number of that second (``-1``: none) and how many entries the second has. So a second's
entries are a backward linked list: head, head.prev, ... -1. Filing a message is O(1)
and never rewrites: append the record, append an entry, update one heads slot.

The heads tables live in one file per hour (``YYYYMMDDHH.heads``, 3,600 slots of newest
i32 + count u32; ``delaymq.scheduler.headstable``), changed only through a **journal**
(the new value of every changed slot, ``pack_journal``) committed in lmdb beside each
hour's committed ``HourSummary`` (``HOURS_DB``) and the replay checkpoint
(``REPLAY_DB``), all moved by one transaction per replay step, and written to the
tables after it. Recovery writes the last journal again first.

Invariants recovery relies on (``EntryChecker``): records are contiguous in the schedule
log (entry ``n + 1`` starts where ``n`` ends), ``source`` strictly grows, and ``prev`` is
exactly the second's head before the entry was added, so the heads table can always be
rebuilt from the index alone (``heads_from_index``). Recovery itself, which reads the
files and the tables, is ``delaymq.scheduler.recovery``; this module imports neither it
nor ``headstable`` (the tables import the slot format from here).
"""

from __future__ import annotations

import os
import struct
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from mmap import mmap
from typing import NamedTuple

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, MAGIC, VERSION
from delaymq.scheduler.hours import HOUR_MS, SECOND_MS, SECONDS_PER_HOUR, CorruptSchedule

ENTRY = struct.Struct(">QIIiQI")
ENTRY_SIZE = ENTRY.size  # 32
ENTRY_BODY = struct.Struct(">QIIiQ")  # the CRC-covered part
ENTRY_CRC = struct.Struct(">I")
INDEX_VERSION = 1
#: Entry numbers are i32 in ``prev``: an hour holds at most this many entries.
MAX_ENTRIES = (1 << 31) - 1

#: A heads slot as a table stores it: newest entry i32, count u32.
HEAD = struct.Struct(">iI")
#: Heads slots in memory (a replay step's, a journal): key ``hour << 12 | second``,
#: value ``(newest + 1) << 32 | count``, 0 for an empty second.
Slots = Mapping[int, int]
#: One journal record: hour u32, second u16, newest i32, count u32.
JOURNAL_RECORD = struct.Struct(">IHiI")


class IndexEntry(NamedTuple):
    """One delay-index entry (without its CRC, which ``read_entry`` checks)."""

    offset: int
    size: int
    ms_in_hour: int
    prev: int
    source: int


@dataclass(frozen=True, slots=True)
class Heads:
    """An hour's second-heads table: per second, the newest entry and the count.

    ``entries`` is the sum of the counts: the snapshot covers exactly the entries
    numbered ``0 .. entries - 1`` (entries filed later are not in it).
    """

    hour: int
    newest: list[int]  # 3,600 entry numbers, -1 = none
    counts: list[int]  # 3,600 counts
    entries: int

    def seconds(self) -> list[int]:
        """The seconds of the hour that hold entries, in order."""
        return [s for s, c in enumerate(self.counts) if c]


def empty_heads() -> tuple[array[int], array[int]]:
    """Fresh ``(newest, counts)`` arrays: no entry in any second."""
    return array("i", [-1]) * SECONDS_PER_HOUR, array("I", [0]) * SECONDS_PER_HOUR


def pack_entry(offset: int, size: int, ms_in_hour: int, prev: int, source: int) -> bytes:
    """One 32-byte entry with its CRC."""
    body = ENTRY_BODY.pack(offset, size, ms_in_hour, prev, source)
    return body + ENTRY_CRC.pack(zlib.crc32(body))


def read_entry(buf: bytes | bytearray | memoryview | mmap, position: int, entry_no: int, where: str) -> IndexEntry:
    """The entry at byte ``position`` of ``buf``, its CRC checked (``where`` names the file)."""
    offset, size, ms, prev, source, crc = ENTRY.unpack_from(buf, position)
    if zlib.crc32(buf[position : position + 28]) != crc:
        raise CorruptSchedule(f"{where}: entry {entry_no} fails its CRC")
    return IndexEntry(offset, size, ms, prev, source)


def hour_key(hour: int) -> bytes:
    return hour.to_bytes(4, "big")


def pack_journal(slots: Slots) -> bytes:
    """The heads journal of ``slots``: one ``JOURNAL_RECORD`` (14 bytes) per slot."""
    pack = JOURNAL_RECORD.pack
    return b"".join(
        pack(key >> 12, key & 0xFFF, (value >> 32) - 1, value & 0xFFFF_FFFF) for key, value in slots.items()
    )


def unpack_journal(data: bytes) -> dict[int, int]:
    """The slots of a heads journal."""
    if len(data) % JOURNAL_RECORD.size:
        raise CorruptSchedule(
            f"heads journal of {len(data)} bytes is not a whole number of {JOURNAL_RECORD.size}-byte records"
        )
    return {
        hour << 12 | second: (newest + 1) << 32 | count if count else 0
        for hour, second, newest, count in JOURNAL_RECORD.iter_unpack(data)
    }


def table_slots(hour: int, newest: Sequence[int], counts: Sequence[int]) -> dict[int, int]:
    """Every slot of ``hour``, empty ones included: the journal that replaces its table."""
    base = hour << 12
    return {base | s: (newest[s] + 1) << 32 | count if count else 0 for s, count in enumerate(counts)}


def heads_from_index(hour: int, index: bytes | bytearray | memoryview, *, where: str = "index") -> Heads:
    """Rebuild an hour's heads table from its delay index alone (every CRC checked).

    The newest entry of a second is its last one in the index and the count is how
    many there are; each ``prev`` is checked against the chain so far.
    """
    if len(index) % ENTRY_SIZE:
        raise CorruptSchedule(f"{where}: {len(index)} bytes is not a whole number of {ENTRY_SIZE}-byte entries")
    newest = [-1] * SECONDS_PER_HOUR
    counts = [0] * SECONDS_PER_HOUR
    view = memoryview(index)
    crc32 = zlib.crc32
    for n, (_offset, _size, ms, prev, _source, crc) in enumerate(ENTRY.iter_unpack(view)):
        p = n * ENTRY_SIZE
        if crc32(view[p : p + 28]) != crc:
            raise CorruptSchedule(f"{where}: entry {n} fails its CRC")
        if ms >= HOUR_MS:
            raise CorruptSchedule(f"{where}: entry {n} has ms_in_hour {ms}, limit {HOUR_MS - 1}")
        second = ms // SECOND_MS
        if prev != newest[second]:
            raise CorruptSchedule(
                f"{where}: entry {n} links to {prev}, but second {second}'s newest entry is {newest[second]}"
            )
        newest[second] = n
        counts[second] += 1
    return Heads(hour, newest, counts, len(index) // ENTRY_SIZE)


# --------------------------------------------------------------------- lmdb layout

HOURS_DB = "schedule.hours"  # hour_key(hour) -> SUMMARY
REPLAY_DB = "schedule.replay"  # CHECKPOINT_KEY -> u64 message-log offset; JOURNAL_KEY -> journal
DELETED_DB = "schedule.deleted"  # hour_key(hour) -> i64 last_source of a deleted hour
CHECKPOINT_KEY = b"checkpoint"
JOURNAL_KEY = b"heads-journal"  # the heads slots the last commit changed (pack_journal)
SUMMARY = struct.Struct(">IQqq")  # entries, log_end, first_source, last_source


class HourSummary:
    """An hour's committed state, as lmdb's ``schedule.hours`` holds it: entries, where
    the schedule log ends, and the message-log offsets of its first and last record."""

    __slots__ = ("entries", "log_end", "first_source", "last_source")

    def __init__(self, entries: int, log_end: int, first_source: int, last_source: int) -> None:
        self.entries = entries
        self.log_end = log_end
        self.first_source = first_source
        self.last_source = last_source

    def pack(self) -> bytes:
        return SUMMARY.pack(self.entries, self.log_end, self.first_source, self.last_source)

    @classmethod
    def unpack(cls, data: bytes) -> HourSummary:
        return cls(*SUMMARY.unpack(data))


class EntryChecker:
    """Checks index entries one after another against the invariants, keeping the heads.

    Recovery feeds it the entries after the last trusted one: ``check`` each, check its
    record in the schedule log, then ``take`` it; the first that fails ends the valid
    prefix. Pure: the caller reads the bytes.
    """

    __slots__ = (
        "newest",
        "counts",
        "entries",
        "log_end",
        "first_source",
        "last_source",
        "next_source",
        "problem",
    )

    def __init__(
        self,
        newest: array[int],
        counts: array[int],
        *,
        entries: int = 0,
        log_end: int = 0,
        first_source: int = -1,
        last_source: int = -1,
        next_source: int = 0,
    ) -> None:
        self.newest = newest
        self.counts = counts
        self.entries = entries  # the next entry number expected
        self.log_end = log_end  # where the next record must start in the schedule log
        self.first_source = first_source  # source of entry 0, -1 before it
        self.last_source = last_source  # source of the last entry taken, -1 before the first
        self.next_source = next_source  # message-log offset just after the last entry's record
        self.problem = ""

    def check(self, buf: bytes | bytearray | memoryview, position: int, log_size: int) -> IndexEntry | None:
        """The entry at ``buf[position:]`` if it can be the next one, else None (``problem`` says why)."""
        n = self.entries
        offset, size, ms, prev, source, crc = ENTRY.unpack_from(buf, position)
        if zlib.crc32(buf[position : position + 28]) != crc:
            self.problem = f"entry {n} fails its CRC"
        elif offset != self.log_end:
            self.problem = f"entry {n} starts at log byte {offset}, expected {self.log_end}"
        elif size < HEADER_SIZE or offset + size > log_size:
            self.problem = f"entry {n}'s record [{offset}, {offset + size}) is not within the log's {log_size} bytes"
        elif source <= self.last_source:
            self.problem = f"entry {n} has source {source}, not after {self.last_source}"
        elif ms >= HOUR_MS:
            self.problem = f"entry {n} has ms_in_hour {ms}, limit {HOUR_MS - 1}"
        elif prev != self.newest[ms // SECOND_MS]:
            second = ms // SECOND_MS
            self.problem = f"entry {n} links to {prev}, second {second}'s newest is {self.newest[second]}"
        elif n >= MAX_ENTRIES:
            self.problem = f"entry {n}: an hour holds at most {MAX_ENTRIES} entries"
        else:
            return IndexEntry(offset, size, ms, prev, source)
        return None

    def take(self, entry: IndexEntry) -> None:
        """Accept a checked entry: link it into its second."""
        second = entry.ms_in_hour // SECOND_MS
        self.newest[second] = self.entries
        self.counts[second] += 1
        if self.entries == 0:
            self.first_source = entry.source
        self.entries += 1
        self.log_end = entry.offset + entry.size
        self.last_source = entry.source
        self.next_source = entry.source + entry.size


def record_problem(buf: bytes | bytearray | memoryview, position: int, size: int, *, check_crc: bool = True) -> str:
    """Why the envelope record of ``size`` bytes at ``buf[position:]`` does not check ("" if it does).

    ``check_crc=False`` checks the envelope's size, magic and version only: for bytes this
    process wrote and kept in memory, where it tells a record from the wrong bytes."""
    if len(buf) < position + size or size < HEADER_SIZE:
        return f"record of {size} bytes is cut short"
    payload_size, magic, version, _kind, crc = HEADER.unpack_from(buf, position)
    if magic != MAGIC or version != VERSION:
        return "record header has a bad magic or version"
    if payload_size + HEADER_SIZE != size:
        return f"record holds {payload_size + HEADER_SIZE} bytes, the index says {size}"
    if not check_crc:
        return ""
    crc32 = zlib.crc32
    # Slicing bytes copies, a memoryview slice costs more to make but nothing per byte.
    data = buf if size < 4096 and type(buf) is bytes else memoryview(buf)
    if crc32(data[position + HEADER_SIZE : position + size], crc32(data[position : position + 8])) != crc:
        return "record fails its CRC"
    return ""


def pread_all(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset`` (fewer only at the end of the file)."""
    data = os.pread(fd, size, offset)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


__all__ = [
    "CHECKPOINT_KEY",
    "DELETED_DB",
    "ENTRY",
    "ENTRY_SIZE",
    "HEAD",
    "JOURNAL_KEY",
    "JOURNAL_RECORD",
    "HOURS_DB",
    "INDEX_VERSION",
    "MAX_ENTRIES",
    "REPLAY_DB",
    "SUMMARY",
    "Slots",
    "EntryChecker",
    "Heads",
    "HourSummary",
    "IndexEntry",
    "empty_heads",
    "heads_from_index",
    "hour_key",
    "pack_entry",
    "pread_all",
    "pack_journal",
    "table_slots",
    "unpack_journal",
    "read_entry",
    "record_problem",
]
