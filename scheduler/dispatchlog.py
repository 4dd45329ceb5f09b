"""The dispatch log of one hour: the entry numbers a realtime server has accepted.

``YYYYMMDDHH.dispatch`` is envelope records (``delaymq.protocol.envelope``) of kind
``DISPATCH`` end to end; each payload is the delay-index entry numbers of one accepted
batch, u32 big-endian each. The dispatcher appends only after the realtime server
accepted the messages, so on restart the set of entries in the log is exactly what
the wheel must skip (``SecondWheel.mark_delivered``).

Appends go to the page cache (safe against a process crash); ``flush`` fsyncs. A lost
tail after a power cut only means those messages are sent again, which the realtime
server's id dedup absorbs, so the dispatcher may flush on an interval. On open a torn
tail (a record cut short or failing its CRC) is cut off; a record that checks but
whose payload is not a list of u32 is corruption and is refused.

In memory the log is a bitmap of the delivered entries and their count, so
``is_complete`` is a comparison and ``delivered`` builds a set only when asked. A store
keeps the logs it uses open in a ``DispatchLogCache`` (bounded, least recently used
closed first), which also keeps the bytes all the folder's dispatch logs hold (``bytes``:
a ``stat`` of each when the store opens, then counted as they are written and deleted)
and times their fsyncs (``fsync_durations``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind, encode, iter_spans, valid_prefix
from delaymq.scheduler.fsyncdurations import FsyncDurations, fsync_clock
from delaymq.scheduler.hours import DISPATCH_SUFFIX, CorruptSchedule, ScheduleError, hour_name
from delaymq.storage.files import pwrite_all
from delaymq.storage.folder import DataFolder

#: Entry numbers per record: a big batch becomes several records of at most 4 MiB.
MAX_ENTRIES_PER_RECORD = 1 << 20
_DISPATCH = int(RecordKind.DISPATCH)
_BIG_ENDIAN = sys.byteorder == "big"
# Bit positions set in each byte value, to turn the bitmap into entry numbers.
_BITS = [tuple(b for b in range(8) if value >> b & 1) for value in range(256)]

_logger = logging.getLogger(__name__)


class DispatchLog:
    """One hour's dispatch log file, its bitmap in memory. Use ``DispatchLog.open``."""

    def __init__(
        self,
        path: Path,
        fd: int,
        size: int,
        bitmap: bytearray,
        count: int,
        *,
        cut_bytes: int = 0,
        fsync_durations: FsyncDurations | None = None,
    ) -> None:
        self._path = path
        self._fd = fd
        self._size = size
        self._bitmap = bitmap
        self._count = count
        self._dirty = False
        self._lock = threading.Lock()
        #: Bytes of a torn tail ``open`` cut off (0 for a log that ended whole).
        self.cut_bytes = cut_bytes
        self._fsync_durations = fsync_durations if fsync_durations is not None else FsyncDurations()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, fsync_durations: FsyncDurations | None = None) -> DispatchLog:
        """Open (creating if missing) and load the log, cutting a torn tail. The fsyncs of
        ``flush`` and ``close`` are timed into ``fsync_durations``."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            data = _read_all(fd)
            valid, error = valid_prefix(data)
            if error is not None:
                _logger.warning(
                    "dispatch log %s: cut %d byte(s) from byte %d: %s",
                    path,
                    len(data) - valid,
                    valid,
                    error.reason,
                )
                os.ftruncate(fd, valid)
                os.fsync(fd)
            bitmap = bytearray()
            count = 0
            for span in iter_spans(data, 0, valid):
                count += _mark(bitmap, _decode(data, span.start, span.end, span.kind, path))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, valid, bitmap, count, cut_bytes=len(data) - valid, fsync_durations=fsync_durations)

    @property
    def path(self) -> Path:
        return self._path

    @property
    def count(self) -> int:
        """How many distinct entries are recorded as delivered."""
        return self._count

    @property
    def size(self) -> int:
        """Bytes in the file."""
        return self._size

    def __contains__(self, entry_no: object) -> bool:
        if type(entry_no) is not int or entry_no < 0:
            return False
        byte = entry_no >> 3
        return byte < len(self._bitmap) and bool(self._bitmap[byte] >> (entry_no & 7) & 1)

    def delivered(self) -> set[int]:
        """The delivered entry numbers."""
        with self._lock:
            return _members(self._bitmap)

    def append(self, entry_nos: Iterable[int]) -> int:
        """Record entries accepted by a realtime server (one write); returns how many were new.

        Entries already recorded are written again but not counted twice.
        """
        numbers = array("I")
        try:
            numbers.extend(entry_nos)
        except (OverflowError, TypeError) as error:
            raise ScheduleError(
                f"entry_nos: every entry number must be an int from 0 to {0xFFFF_FFFF} ({error})"
            ) from None
        if not numbers:
            return 0
        raw = memoryview(pack_entries(numbers))
        step = MAX_ENTRIES_PER_RECORD * 4
        data = b"".join(encode(_DISPATCH, raw[i : i + step]) for i in range(0, len(raw), step))
        with self._lock:
            if self._fd < 0:
                raise ScheduleError(f"dispatch log {self._path} is closed")
            _append_or_cut_back(self._fd, data, self._size, self._path)
            self._size += len(data)
            self._dirty = True
            new = _mark(self._bitmap, numbers)
            self._count += new
        return new

    def flush(self) -> None:
        """fsync what was appended."""
        with self._lock:
            if self._dirty and self._fd >= 0:
                started = fsync_clock()
                os.fdatasync(self._fd)
                self._fsync_durations.since(started)
                self._dirty = False

    def close(self) -> None:
        """Flush and close."""
        with self._lock:
            if self._fd < 0:
                return
            try:
                if self._dirty:
                    started = fsync_clock()
                    os.fdatasync(self._fd)
                    self._fsync_durations.since(started)
            finally:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> DispatchLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DispatchLog {self._path} delivered={self._count}>"


class DispatchLogCache:
    """The dispatch logs of one schedule folder, opened when first needed; beyond
    ``max_open`` the least recently used is closed (and loaded again when next needed),
    so the open files stay bounded however many hours are pending.

    Thread use: every call holds ``lock`` (an ``RLock``); the store holds it too around
    a deletion, so no log of the hour is opened again midway. ``bytes`` is read without it.
    """

    def __init__(self, folder: DataFolder, *, max_open: int, fsync: bool, hours: Iterable[int] = ()) -> None:
        """``hours``: those whose dispatch log the folder holds (``stat`` once each, for ``bytes``)."""
        self._folder = folder
        self._max_open = max_open
        self._fsync = fsync  # fsync the folder after creating a log
        self._logs: OrderedDict[int, DispatchLog] = OrderedDict()
        self.lock = threading.RLock()
        self.fsync_durations = FsyncDurations()  # each fsync of a flush (or of a close after appends)
        self._bytes = sum(self._file_size(hour) for hour in hours)

    @property
    def bytes(self) -> int:
        """Bytes the folder's dispatch logs hold on disk (what is appended is counted at once)."""
        return self._bytes

    def append(self, hour: int, entry_nos: Iterable[int]) -> int:
        """``DispatchLog.append`` to ``hour``'s log, created if missing."""
        with self.lock:
            log = self._open(hour, create=True)
            assert log is not None
            before = log.size
            try:
                return log.append(entry_nos)
            finally:
                self._bytes += log.size - before

    def flush(self) -> None:
        """fsync every log appended to since the last flush."""
        with self.lock:
            for log in self._logs.values():
                log.flush()

    def delivered(self, hour: int) -> set[int]:
        """The entries of ``hour`` recorded as delivered (none for an hour without a log)."""
        with self.lock:
            log = self._open(hour, create=False)
            return set() if log is None else log.delivered()

    def count(self, hour: int) -> int:
        """How many distinct entries of ``hour`` are recorded as delivered."""
        with self.lock:
            log = self._open(hour, create=False)
            return 0 if log is None else log.count

    def forget(self, hour: int) -> None:
        """Close ``hour``'s log if it is open and stop counting its bytes (its file is about
        to be deleted)."""
        with self.lock:
            log = self._logs.pop(hour, None)
            if log is not None:
                log.close()
            self._bytes -= log.size if log is not None else self._file_size(hour)

    def close(self) -> None:
        """Flush and close every open log."""
        with self.lock:
            for log in self._logs.values():
                log.close()
            self._logs.clear()

    def _open(self, hour: int, *, create: bool) -> DispatchLog | None:
        log = self._logs.get(hour)
        if log is not None:
            self._logs.move_to_end(hour)
            return log
        path = self._folder.path / (hour_name(hour) + DISPATCH_SUFFIX)
        exists = path.exists()
        if not exists and not create:
            return None
        log = DispatchLog.open(path, fsync_durations=self.fsync_durations)
        self._bytes -= log.cut_bytes  # counted as the file was; a torn tail is gone now
        if not exists and self._fsync:
            self._folder.fsync()
        self._logs[hour] = log
        while len(self._logs) > self._max_open:
            _old, evicted = self._logs.popitem(last=False)
            evicted.close()
        return log

    def _file_size(self, hour: int) -> int:
        try:
            return os.stat(self._folder.path / (hour_name(hour) + DISPATCH_SUFFIX)).st_size
        except FileNotFoundError:
            return 0


def read_delivered(path: str | os.PathLike[str]) -> set[int]:
    """The delivered entries of a dispatch log file, read only (for tools; a torn tail is ignored)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return set()
    valid, _error = valid_prefix(data)
    bitmap = bytearray()
    for span in iter_spans(data, 0, valid):
        _mark(bitmap, _decode(data, span.start, span.end, span.kind, Path(path)))
    return _members(bitmap)


def _decode(data: bytes, start: int, end: int, kind: int, path: Path) -> array[int]:
    if kind != _DISPATCH:
        raise CorruptSchedule(
            f"dispatch log {path}: record at byte {start} is of kind {kind}, not DISPATCH ({_DISPATCH})"
        )
    size = end - start - HEADER_SIZE
    if size % 4:
        raise CorruptSchedule(f"dispatch log {path}: record at byte {start} holds {size} bytes, not whole u32 entries")
    return unpack_entries(data[start + HEADER_SIZE : end])


def pack_entries(numbers: array[int]) -> bytes:
    """Entry numbers as a dispatch record's payload: u32 big-endian each (also the
    replication journal's form, ``delaymq.scheduler.replica``)."""
    if _BIG_ENDIAN:
        return numbers.tobytes()
    wire = array("I", numbers)
    wire.byteswap()
    return wire.tobytes()


def unpack_entries(payload: bytes | memoryview) -> array[int]:
    """``pack_entries`` read back (the payload's length is a multiple of 4)."""
    numbers = array("I")
    numbers.frombytes(payload)
    if not _BIG_ENDIAN:
        numbers.byteswap()
    return numbers


def _members(bitmap: bytearray) -> set[int]:
    found: set[int] = set()
    bits = _BITS
    for i, value in enumerate(bitmap):
        if value:
            base = i << 3
            found.update(base + b for b in bits[value])
    return found


def _mark(bitmap: bytearray, numbers: array[int]) -> int:
    """Set each number's bit; how many were not set before."""
    if not numbers:
        return 0
    need = (max(numbers) >> 3) + 1
    if need > len(bitmap):
        bitmap.extend(bytes(need - len(bitmap)))
    new = 0
    for n in numbers:
        byte = n >> 3
        bit = 1 << (n & 7)
        old = bitmap[byte]
        if not old & bit:
            bitmap[byte] = old | bit
            new += 1
    return new


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    parts = []
    position = 0
    while position < size:
        chunk = os.pread(fd, min(size - position, 64 << 20), position)
        if not chunk:
            break
        parts.append(chunk)
        position += len(chunk)
    return b"".join(parts)


def _append_or_cut_back(fd: int, data: bytes, position: int, path: Path) -> None:
    """All of ``data`` at ``position``; on failure the file is cut back there (no torn
    record stays behind for the next append to follow) and ``ScheduleError`` says why."""
    try:
        pwrite_all(fd, data, position, path=path)
    except OSError as error:
        try:
            os.ftruncate(fd, position)
        except OSError:
            pass
        raise ScheduleError(f"append of {len(data)} bytes to dispatch log {path} failed: {error}") from error


__all__ = [
    "MAX_ENTRIES_PER_RECORD",
    "DispatchLog",
    "DispatchLogCache",
    "pack_entries",
    "read_delivered",
    "unpack_entries",
]
