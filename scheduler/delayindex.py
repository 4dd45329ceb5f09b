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
rebuilt from the index alone (``heads_from_index``). ``recover_hours`` runs when the
store opens: it writes the last journal into the tables again, keeps each hour's
longest valid prefix of entries (whose records check), rolls the heads forward over
valid entries a crash left uncommitted, and, should committed entries or a table be
gone, rebuilds the heads and (for lost entries) moves the checkpoint back so replay
files them again with the same numbers.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from delaymq.protocol.envelope import HEADER, HEADER_SIZE, MAGIC, VERSION
from delaymq.scheduler.hours import (
    DISPATCH_SUFFIX,
    HEADS_SUFFIX,
    HOUR_MS,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SECOND_MS,
    SECONDS_PER_HOUR,
    CorruptSchedule,
    hour_name,
    parse_hour_name,
)
from delaymq.storage.folder import DataFolder
from delaymq.storage.state import StateStore, WriteBatch

if TYPE_CHECKING:
    from delaymq.scheduler.headstable import HeadsTables

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

_logger = logging.getLogger(__name__)


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


def read_entry(buf: bytes | bytearray | memoryview, position: int, entry_no: int, where: str) -> IndexEntry:
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
        raise CorruptSchedule(
            f"{where}: {len(index)} bytes is not a whole number of {ENTRY_SIZE}-byte entries"
        )
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
                f"{where}: entry {n} links to {prev}, "
                f"but second {second}'s newest entry is {newest[second]}"
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
            self.problem = (
                f"entry {n}'s record [{offset}, {offset + size}) is not within the log's {log_size} bytes"
            )
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


def record_problem(buf: bytes | bytearray | memoryview, position: int, size: int) -> str:
    """Why the envelope record of ``size`` bytes at ``buf[position:]`` does not check ("" if it does)."""
    if len(buf) < position + size or size < HEADER_SIZE:
        return f"record of {size} bytes is cut short"
    payload_size, magic, version, _kind, crc = HEADER.unpack_from(buf, position)
    if magic != MAGIC or version != VERSION:
        return "record header has a bad magic or version"
    if payload_size + HEADER_SIZE != size:
        return f"record holds {payload_size + HEADER_SIZE} bytes, the index says {size}"
    view = memoryview(buf)
    crc32 = zlib.crc32
    if crc32(view[position + HEADER_SIZE : position + size], crc32(view[position : position + 8])) != crc:
        return "record fails its CRC"
    return ""




# --------------------------------------------------------------------- recovery

_CHECK_WINDOW = 8 << 20  # recovery reads the schedule log this much at a time


def recover_hours(
    folder: DataFolder, state: StateStore, names: list[str], tables: HeadsTables
) -> tuple[dict[int, HourSummary], int, int]:
    """Bring every hour's files back to a consistent state; returns summaries, checkpoint
    (lowered if an hour lost committed entries) and how many hours were repaired.

    First the last commit's heads journal is written into the tables again (its slots
    may not have reached them), then each hour is checked. The heads changes recovery
    makes are committed as a journal with its lmdb changes and written after, like a
    replay step's.
    """
    files: dict[int, set[str]] = {}
    for name in names:
        stem, dot, suffix = name.partition(".")
        if not dot or "." + suffix not in (LOG_SUFFIX, INDEX_SUFFIX, DISPATCH_SUFFIX, HEADS_SUFFIX):
            continue
        try:
            hour = parse_hour_name(stem)
        except ValueError:
            continue
        files.setdefault(hour, set()).add("." + suffix)
    committed = {int.from_bytes(k, "big"): HourSummary.unpack(v) for k, v in state.items(HOURS_DB)}
    stored = state.get(REPLAY_DB, CHECKPOINT_KEY)
    checkpoint = int.from_bytes(stored, "big") if stored is not None else 0
    journal = state.get(REPLAY_DB, JOURNAL_KEY)
    if journal:
        redo = unpack_journal(journal)
        usable = {hour for hour in {key >> 12 for key in redo} if hour in committed and tables.exists(hour)}
        tables.write({key: value for key, value in redo.items() if key >> 12 in usable})
        tables.sync()
    summaries: dict[int, HourSummary] = {}
    restart = checkpoint
    repaired = 0
    unlinked = False
    slots: dict[int, int] = {}
    with state.write() as batch:
        for hour in sorted(files.keys() | committed.keys()):
            outcome = _recover_hour(folder, batch, tables, slots, hour, files.get(hour, set()), committed.get(hour))
            summary, hour_restart, changed, removed = outcome
            if summary is not None:
                summaries[hour] = summary
            if hour_restart is not None:
                restart = min(restart, hour_restart)
            repaired += changed
            unlinked |= removed
        if restart < checkpoint:
            _logger.warning(
                "schedule %s: replay goes back from checkpoint %d to %d to re-file lost entries",
                folder.path,
                checkpoint,
                restart,
            )
            batch.put(REPLAY_DB, CHECKPOINT_KEY, restart.to_bytes(8, "big"))
            checkpoint = restart
        if slots:
            batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(slots))
        elif journal:
            batch.delete(REPLAY_DB, JOURNAL_KEY)  # written again above and synced
        if tables.unsynced():  # tables created for repairs: durable before the journal
            tables.sync()
            folder.fsync()
    if slots:
        tables.write(slots)
        tables.sync()
    if unlinked or repaired:
        folder.fsync()
    return summaries, checkpoint, repaired


def _recover_hour(
    folder: DataFolder,
    batch: WriteBatch,
    tables: HeadsTables,
    slots: dict[int, int],
    hour: int,
    present: set[str],
    summary: HourSummary | None,
) -> tuple[HourSummary | None, int | None, bool, bool]:
    """One hour: ``(summary or None, replay restart or None, repaired?, files removed?)``.
    The heads changes it needs go into ``slots``."""
    name = hour_name(hour)
    base = folder.path / name
    committed = summary.entries if summary is not None else 0
    if INDEX_SUFFIX not in present and committed == 0:
        removed = False
        if LOG_SUFFIX in present:  # a log without an index holds nothing filed
            Path(str(base) + LOG_SUFFIX).unlink()
            removed = True
        if HEADS_SUFFIX in present:  # a table without an index counts nothing
            tables.remove(hour)
            removed = True
        return None, None, False, removed
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
    index_fd = os.open(str(base) + INDEX_SUFFIX, flags, 0o644)
    log_fd = -1
    try:
        log_fd = os.open(str(base) + LOG_SUFFIX, flags, 0o644)
        index_size = os.fstat(index_fd).st_size
        log_size = os.fstat(log_fd).st_size
        stop = index_size // ENTRY_SIZE
        heads: Heads | None = None
        if committed and stop > committed:  # entries to roll forward over: from the committed heads
            heads = tables.read(hour)
            if heads is not None and heads.entries != committed:
                heads = None
            table_lost = heads is None
        else:
            table_lost = committed > 0 and not tables.exists(hour)
        if table_lost:
            _logger.warning(
                "schedule %s: hour %s: its heads table is missing or does not count its %d entries; "
                "rebuilding it from the index",
                folder.path,
                name,
                committed,
            )
        trusted = (
            not table_lost
            and summary is not None
            and _committed_end_checks(index_fd, log_fd, stop, log_size, summary)
        )
        if trusted or committed == 0:
            assert summary is not None or committed == 0
            start = committed
            if heads is not None:
                newest, counts = array("i", heads.newest), array("I", heads.counts)
            else:
                newest, counts = empty_heads()
            s = summary or HourSummary(0, 0, -1, -1)
            last_size = 0
            if committed:
                raw = pread_all(index_fd, ENTRY_SIZE, (committed - 1) * ENTRY_SIZE)
                last_size = read_entry(raw, 0, committed - 1, name).size
            checker = EntryChecker(
                newest,
                counts,
                entries=committed,
                log_end=s.log_end,
                first_source=s.first_source,
                last_source=s.last_source,
                next_source=s.last_source + last_size if committed else 0,
            )
        else:
            start = 0
            newest, counts = empty_heads()
            checker = EntryChecker(newest, counts)
        touched = _check_entries(checker, index_fd, log_fd, start, stop, log_size, name)
        kept = checker.entries
        changed = index_size != kept * ENTRY_SIZE or log_size != checker.log_end
        if changed:
            _logger.warning(
                "schedule %s: hour %s: kept %d entries of %d (%d committed): %s",
                folder.path,
                name,
                kept,
                stop,
                committed,
                checker.problem or "torn tail",
            )
            os.ftruncate(index_fd, kept * ENTRY_SIZE)
            os.ftruncate(log_fd, checker.log_end)
            os.fsync(index_fd)
            os.fsync(log_fd)
    finally:
        os.close(index_fd)
        if log_fd >= 0:
            os.close(log_fd)
    restart: int | None = None
    if kept < committed:
        # Committed entries are gone (the files were damaged): rebuild the heads and
        # replay again from just after the last entry kept.
        assert summary is not None
        restart = checker.next_source if kept else summary.first_source
    if kept == 0:
        if summary is not None:
            batch.delete(HOURS_DB, hour_key(hour))
        for suffix in (INDEX_SUFFIX, LOG_SUFFIX):
            Path(str(base) + suffix).unlink(missing_ok=True)
        tables.remove(hour)
        return None, restart, changed or kept != committed, True
    if kept < committed or table_lost or committed == 0:
        tables.create(hour)  # a whole table, every slot written by the journal
        slots.update(table_slots(hour, checker.newest, checker.counts))
    elif kept > committed:
        base_key = hour << 12
        for second in touched:
            slots[base_key | second] = (checker.newest[second] + 1) << 32 | checker.counts[second]
    result = HourSummary(kept, checker.log_end, checker.first_source, checker.last_source)
    if kept != committed:
        batch.put(HOURS_DB, hour_key(hour), result.pack())
    return result, restart, changed or kept != committed or table_lost, False


def _committed_end_checks(
    index_fd: int, log_fd: int, stop: int, log_size: int, summary: HourSummary
) -> bool:
    """Whether the hour's last committed entry and its record are intact where the summary says."""
    n = summary.entries
    if n == 0:
        return True
    if stop < n or log_size < summary.log_end:
        return False
    buf = pread_all(index_fd, ENTRY_SIZE, (n - 1) * ENTRY_SIZE)
    offset, size, _ms, _prev, source, crc = ENTRY.unpack(buf)
    if zlib.crc32(buf[:28]) != crc or offset + size != summary.log_end or source != summary.last_source:
        return False
    return not record_problem(pread_all(log_fd, size, offset), 0, size)


def _check_entries(
    checker: EntryChecker, index_fd: int, log_fd: int, start: int, stop: int, log_size: int, name: str
) -> set[int]:
    """Feed entries ``start .. stop - 1`` and their records to ``checker`` until one fails;
    returns the seconds the accepted ones fall in."""
    touched: set[int] = set()
    window = b""
    window_start = 0
    n = start
    while n < stop:
        count = min(stop - n, 1 << 16)
        buf = pread_all(index_fd, count * ENTRY_SIZE, n * ENTRY_SIZE)
        for i in range(count):
            entry = checker.check(buf, i * ENTRY_SIZE, log_size)
            if entry is None:
                return touched
            position = entry.offset - window_start
            if position < 0 or position + entry.size > len(window):
                window_start = entry.offset
                size = min(max(_CHECK_WINDOW, entry.size), log_size - entry.offset)
                window = pread_all(log_fd, size, entry.offset)
                position = 0
            problem = record_problem(window, position, entry.size)
            if problem:
                checker.problem = f"entry {checker.entries}'s record at log byte {entry.offset}: {problem}"
                return touched
            checker.take(entry)
            touched.add(entry.ms_in_hour // SECOND_MS)
        n += count
    return touched


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
    "recover_hours",
]
