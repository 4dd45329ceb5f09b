"""Reading one hour of the schedule: its heads, second chains, index entries and records.

``ScheduleStore.open_hour`` gives an ``HourLog``; the dispatcher uses it from its worker
threads while replay files into the same hour. It reads only what the store has
committed: the entry count and heads from the store (``CommittedHours``), entries from
the delay index mapped read-only (the file is only ever appended to, so a mapping is
grown, never invalidated), records from the schedule log with ``pread``, records close
together in one read; or, when the message log still keeps the bytes it was filed from
in memory (``recent_source``: a message due within seconds of its arrival), from there. ``chain`` and ``read_records`` are the dispatcher's hot loops:
their aliases of bound methods are deliberate. The dispatcher reads records so that one
that does not check (damage on disk) costs only itself: ``read_records(..., damaged=[])``
gives ``b""`` for it and says where and why (``DamagedRecord``).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind
from delaymq.protocol.limits import MESSAGE_HEADER_SIZE
from delaymq.scheduler.delayindex import ENTRY, ENTRY_SIZE, Heads, IndexEntry, pread_all, read_entry, record_problem
from delaymq.scheduler.hours import (
    INDEX_SUFFIX,
    LOG_SUFFIX,
    SECOND_MS,
    SECONDS_PER_HOUR,
    CorruptSchedule,
    ScheduleError,
    hour_name,
)

_READ_GAP = 64 << 10  # read_records reads across gaps up to this size in one pread
_READ_SPAN = 4 << 20  # ... into spans of at most this size
_MESSAGE = int(RecordKind.MESSAGE)
_KIND = struct.Struct(">H")  # an envelope's kind, at byte 6
_NAMES = struct.Struct(">HH")  # a message record's id_len and subject_len, at byte 30


class DamagedRecord(NamedTuple):
    """A record of an hour's schedule log that did not check when it was read: where, and why."""

    hour: int
    entry: int
    offset: int  # where it starts in the hour's schedule log
    problem: str

    def __str__(self) -> str:
        return f"hour {hour_name(self.hour)}: entry {self.entry}'s record at log byte {self.offset}: {self.problem}"


class CommittedHours(Protocol):
    """What an ``HourLog`` asks its store (``ScheduleStore``): the committed state."""

    @property
    def directory(self) -> Path: ...

    def entries(self, hour: int) -> int: ...

    def heads(self, hour: int) -> Heads: ...

    def newest_entry(self, hour: int, second: int) -> int: ...

    #: The bytes ``[source, source + size)`` of the message log for each ``(source, size)``,
    #: or None where it does not keep them in memory (``SegmentedLog.read_recent_many``):
    #: what an entry was filed from, byte for byte.
    recent_source: Callable[[list[tuple[int, int]]], list[bytes | None]] | None


class HourLog:
    """A reader of one hour: heads, chains, entries and records. Use ``ScheduleStore.open_hour``.

    Reads entries the store has committed (it learns their numbers from ``heads`` and
    replay arrivals). Safe to use from another thread than the one filing; one
    ``HourLog`` is used by one thread at a time. Close it before ``delete_hour``.
    """

    def __init__(self, store: CommittedHours, hour: int) -> None:
        self._store = store
        self._hour = hour
        self._name = hour_name(hour)
        folder = store.directory
        self._index_path = folder / (self._name + INDEX_SUFFIX)
        self._index_fd = os.open(self._index_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._log_fd = os.open(folder / (self._name + LOG_SUFFIX), os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self._index_fd)
            raise
        self._map: mmap.mmap | None = None
        self._mapped = 0

    @property
    def hour(self) -> int:
        return self._hour

    @property
    def name(self) -> str:
        """``YYYYMMDDHH``."""
        return self._name

    @property
    def entries(self) -> int:
        """Committed entries of the hour, numbered ``0 .. entries - 1``."""
        return self._store.entries(self._hour)

    def heads(self) -> Heads:
        """The committed heads table: per second the newest entry and the count."""
        return self._store.heads(self._hour)

    def entry(self, entry_no: int) -> IndexEntry:
        """One entry (offset, size, ms_in_hour, prev, source), its CRC checked."""
        index = self._index_for(entry_no)
        return read_entry(index, entry_no * ENTRY_SIZE, entry_no, str(self._index_path))

    def chain(self, second: int, *, below: int | None = None, floor: int = 0) -> list[tuple[int, int]]:
        """``(ms_in_hour, entry_no)`` of every entry of ``second`` (0..3599), newest first.

        Walks the second's backward linked list from its newest committed entry (as the
        stored heads say). Only entries numbered ``floor <= n < below`` are returned
        (``below`` defaults to ``entries``): pass the number of entries your wheel knows
        (``heads().entries`` plus the arrivals applied since), so an entry committed
        since, still to be reported as an arrival, is not taken twice; pass
        ``SecondWheel.walk_floor(second)`` as ``floor`` to stop early.
        """
        if type(second) is not int or not 0 <= second < SECONDS_PER_HOUR:
            raise ScheduleError(f"second={second!r}: must be a second of the hour, 0..{SECONDS_PER_HOUR - 1}")
        limit = self.entries if below is None else below
        n = self._store.newest_entry(self._hour, second)
        index = self._index_for(n) if n >= 0 else b""
        unpack = ENTRY.unpack_from
        crc32 = zlib.crc32
        low, high = second * SECOND_MS, (second + 1) * SECOND_MS
        out: list[tuple[int, int]] = []
        append = out.append
        floor = max(floor, 0)
        while n >= floor:
            p = n * ENTRY_SIZE
            _offset, _size, ms, prev, _source, crc = unpack(index, p)
            if crc32(index[p : p + 28]) != crc or not low <= ms < high or prev >= n:
                read_entry(index, p, n, str(self._index_path))  # raises for a bad CRC
                raise CorruptSchedule(
                    f"{self._index_path}: entry {n} in second {second}'s chain has ms_in_hour {ms} "
                    f"and prev {prev} (must be in {low}..{high - 1} and below {n})"
                )
            if n < limit:
                append((ms, n))
            n = prev
        return out

    def read_records(self, entry_nos: Sequence[int], *, damaged: list[DamagedRecord] | None = None) -> list[bytes]:
        """The full message records of ``entry_nos``, in the order given, each checked.

        One that does not check raises ``CorruptSchedule``; with ``damaged`` (a list) it is
        ``b""`` instead and added there (its envelope, CRC, and that it is a message record
        whose id and subject fit in it), so the others are still read.

        A record whose message-log bytes are still in memory (``recent_source``) comes from
        there: no read, and its CRC not checked again (this process checked and wrote it).
        They are the bytes it was filed from: an entry's ``source`` names them while the
        entry exists (a cutback drops entries at or past the cut before the log truncates,
        which forgets what it kept); its envelope (size, magic, version) is checked as a
        guard. The others come from the schedule log, CRC checked, records close together
        with one ``pread``.
        """
        if not entry_nos:
            return []
        index = self._index_for(max(entry_nos))
        if min(entry_nos) < 0:
            self._index_for(min(entry_nos))  # raises, naming it
        unpack = ENTRY.unpack_from
        entries = [unpack(index, n * ENTRY_SIZE) for n in entry_nos]
        out: list[bytes] = [b""] * len(entry_nos)
        recent = self._store.recent_source
        if recent is None:
            located = [(entry[0], entry[1], i) for i, entry in enumerate(entries)]
        else:
            located = []
            kept = recent([(entry[4], entry[1]) for entry in entries])
            for i, (entry, record) in enumerate(zip(entries, kept)):
                if record is not None and not record_problem(record, 0, entry[1], check_crc=False):
                    out[i] = record
                else:
                    located.append((entry[0], entry[1], i))
        located.sort()
        k = 0
        while k < len(located):
            start, size, _i = located[k]
            end = start + size
            j = k + 1
            while j < len(located):
                offset, length, _ = located[j]
                if offset - end > _READ_GAP or offset + length - start > _READ_SPAN:
                    break
                end = max(end, offset + length)
                j += 1
            buf = pread_all(self._log_fd, end - start, start)
            for offset, length, i in located[k:j]:
                position = offset - start
                problem = record_problem(buf, position, length)
                if damaged is not None and not problem:
                    problem = _message_problem(buf, position, length)
                if problem:
                    if damaged is None:
                        raise CorruptSchedule(
                            f"hour {self._name}: entry {entry_nos[i]}'s record at log byte {offset}: {problem}"
                        )
                    damaged.append(DamagedRecord(self._hour, entry_nos[i], offset, problem))
                    continue
                out[i] = buf[position : position + length]
            k = j
        return out

    def _index_for(self, entry_no: int) -> mmap.mmap:
        """The index mapped far enough to hold ``entry_no`` (the file is only ever appended to)."""
        need = (entry_no + 1) * ENTRY_SIZE
        if need > self._mapped or entry_no < 0:
            size = os.fstat(self._index_fd).st_size
            if entry_no < 0 or size < need:
                raise ScheduleError(f"hour {self._name}: entry_no {entry_no} is outside 0..{size // ENTRY_SIZE - 1}")
            old = self._map
            self._map = mmap.mmap(self._index_fd, size, access=mmap.ACCESS_READ)
            self._mapped = size
            if old is not None:
                old.close()
        assert self._map is not None
        return self._map

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
            self._mapped = 0
        for fd in (self._index_fd, self._log_fd):
            if fd >= 0:
                os.close(fd)
        self._index_fd = self._log_fd = -1

    def __enter__(self) -> HourLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HourLog {self._name} entries={self.entries}>"


def _message_problem(buf: bytes, position: int, size: int) -> str:
    """Why the record of ``size`` bytes at ``buf[position:]`` (its envelope checked) cannot be
    sent as a message: what the dispatcher reads of it at fixed offsets must be there."""
    kind = _KIND.unpack_from(buf, position + 6)[0]
    if kind != _MESSAGE or size < HEADER_SIZE + MESSAGE_HEADER_SIZE:
        return f"a record of kind {kind} and {size} bytes is no message record"
    id_len, subject_len = _NAMES.unpack_from(buf, position + 30)
    if HEADER_SIZE + MESSAGE_HEADER_SIZE + id_len + subject_len > size:
        return "the message record's id and subject run past its end"
    return ""


__all__ = ["CommittedHours", "DamagedRecord", "HourLog"]
