"""The segmented log: a folder of segment files holding envelope records end to end.

Offsets are global byte positions (as in RocketMQ's commit log): a segment file is
named by the offset of its first byte, in 20 zero-padded digits, and holds records
that never span two segments. A batch goes to disk in one ``os.pwrite``; a batch
that would push the active segment past ``segment_size`` starts a new segment (a
batch bigger than a segment gets one of its own).

Crash safety rests on two rules: a segment is fsynced before the next one is
created, so only the last segment can have a torn tail; and on open that tail is
cut at the first record that does not check (envelope size, magic, version, CRC).
The open checks only what no earlier process vouched for: the log keeps its
*verified end* (``delaymq.storage.verified``), below which every byte is a whole,
fsynced record, moved on by a flush once it is ``checkpoint_bytes`` behind, so
an open reads at most about that much plus the unflushed tail, not the whole last
segment. Bytes below it are trusted as older segments always were: damage there
(a bad disk) is found by the read that meets it (``NotRecordStart``). A verified
end that does not check, or no longer matches the segment, is ignored (logged)
and the whole last segment is checked.
A write that fails (a full disk) is cut back at once, so no torn record is ever
followed by later ones; after a failed fsync the log refuses appends until it is
reopened or its owner cuts the unflushed tail (``drop_unflushed``).

Threads: one thread appends and flushes while readers run in others (the event
loop included). ``end_offset`` moves only after a write has returned, so a reader
never sees a half-written record; the segment index is replaced, never mutated,
so a reader's snapshot of it stays consistent. Blocking calls are meant to run
through a ``run_blocking`` (``delaymq.storage.threads``); ``delaymq.storage.writer``
does that for appends.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from bisect import bisect_right
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from delaymq.protocol.envelope import (
    HEADER,
    HEADER_SIZE,
    CorruptRecord,
    EnvelopeError,
    Span,
    TruncatedRecord,
    encode,
    iter_spans,
)
from delaymq.storage.errors import (
    CorruptLog,
    LogClosed,
    LogFailed,
    LogIOError,
    NotRecordStart,
    OffsetBeyondEnd,
    OffsetDeleted,
    RecordTooLarge,
)
from delaymq.storage.files import pwrite_all
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import FormatValue, ensure_format
from delaymq.storage.recent import RecentBytes
from delaymq.storage.verified import VerifiedEnd, VerifiedEndFile, read_verified, tail_crc

LOG_FORMAT = "segmented-log"
LOG_FORMAT_VERSION = 1
DEFAULT_SEGMENT_SIZE = 1 << 30
DEFAULT_MAX_RECORD = 16 << 20
#: A flush saves the verified end once it is this far behind: what an open checks again at most.
DEFAULT_CHECKPOINT_BYTES = 16 << 20
SEGMENT_NAME_DIGITS = 20
_SEGMENT_NAME = re.compile(r"^[0-9]{%d}$" % SEGMENT_NAME_DIGITS)
_SCAN_CHUNK = 8 << 20  # recovery reads the last segment this much at a time
_FIRST_READ = 4096  # read() fetches this much first, then the rest of a big record
_RESERVED_PARAMS = frozenset({"format", "version", "segment_size", "max_record"})

_logger = logging.getLogger(__name__)


def check_max_record(max_record: int) -> None:
    """``ValueError`` if protocol limits allow records larger than a message log holds.

    Servers open their message log with ``DEFAULT_MAX_RECORD``; they check their
    limits against it before touching the data folder.
    """
    if max_record > DEFAULT_MAX_RECORD:
        raise ValueError(
            f"limits allow records of {max_record} bytes; the message log holds at most {DEFAULT_MAX_RECORD}"
        )


class Recovery(NamedTuple):
    """What an open found: the verified end it started from, the bytes it checked and cut."""

    verified_end: int  # the stored verified end the open relied on (0: none usable)
    checked_bytes: int  # bytes whose records the open read and checked
    cut_bytes: int  # torn or damaged bytes cut from the end
    distrusted: str | None = None  # why a stored verified end was ignored, if it was


class Record(NamedTuple):
    """One record read back: where it starts, its kind and payload, and where the next starts."""

    offset: int
    kind: int
    payload: bytes
    next_offset: int


def segment_name(base: int) -> str:
    return f"{base:0{SEGMENT_NAME_DIGITS}d}"


def segment_bases(directory: str | os.PathLike[str]) -> list[int]:
    """The first offsets of the segment files in ``directory``, ascending (other files ignored)."""
    return sorted(int(name) for name in os.listdir(directory) if _SEGMENT_NAME.match(name))


class _Segment:
    """One segment file: its first offset, its length and an open descriptor.

    A deleted segment is dropped from the index but its descriptor stays open
    until the last reader holding it lets go (``__del__``), so a concurrent read
    of a segment being deleted reads the unlinked file, never a reused fd.
    """

    __slots__ = ("base", "size", "fd", "path")

    def __init__(self, base: int, path: Path, fd: int, size: int) -> None:
        self.base = base
        self.path = path
        self.fd = fd
        self.size = size

    @property
    def end(self) -> int:
        return self.base + self.size

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass


class SegmentedLog:
    """An append-only log of envelope records in segment files. Use ``SegmentedLog.open``."""

    def __init__(
        self,
        folder: DataFolder,
        segments: list[_Segment],
        *,
        segment_size: int,
        max_record: int,
        verified: VerifiedEndFile,
        verified_end: int,
        recovery: Recovery,
        checkpoint_bytes: int,
    ) -> None:
        self._folder = folder
        self._segment_size = segment_size
        self._max_record = max_record
        self._verified = verified
        self._verified_end = verified_end
        self._verified_tried = self._verified_end  # a failed save is tried again checkpoint_bytes later
        self._verified_failing = False
        self._checkpoint_bytes = checkpoint_bytes
        self.recovery = recovery
        # (bases, segments): replaced as a whole under _index_lock, read without a lock.
        self._index: tuple[list[int], list[_Segment]] = ([s.base for s in segments], segments)
        self._active = segments[-1]
        self._end = self._active.end
        self._flushed = self._end
        self._append_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._closed = False
        self._failure: BaseException | None = None
        self._recent: RecentBytes | None = None  # see keep_recent

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        max_record: int = DEFAULT_MAX_RECORD,
        extra_format: Mapping[str, FormatValue] | None = None,
        checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
    ) -> SegmentedLog:
        """Open (or create) the log in ``directory``, cutting a torn tail.

        ``max_record`` is the largest payload a record may have; recovery reads a
        bigger size field as corruption. It and ``segment_size`` are stored in the
        folder's FORMAT file, with ``extra_format`` (a caller's own parameters),
        and a later open with other values raises ``FormatMismatch``.
        ``checkpoint_bytes``: how far the flushed end may run ahead of the saved
        verified end (what the next open checks again at most, besides the
        unflushed tail); each save costs one small write and ``fdatasync``.
        """
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, got {segment_size}")
        if checkpoint_bytes <= 0:
            raise ValueError(f"checkpoint_bytes must be positive, got {checkpoint_bytes}")
        if not 0 < max_record < 1 << 32:
            raise ValueError(f"max_record must be in [1, {(1 << 32) - 1}], got {max_record}")
        params: dict[str, FormatValue] = {
            "format": LOG_FORMAT,
            "version": LOG_FORMAT_VERSION,
            "segment_size": segment_size,
            "max_record": max_record,
        }
        for name, value in (extra_format or {}).items():
            if name in _RESERVED_PARAMS:
                raise ValueError(f"extra_format may not set the log's own parameter {name!r}")
            params[name] = value
        folder = DataFolder(directory, what="segmented log")
        try:
            bases = segment_bases(folder.path)
            ensure_format(folder.path, params, has_data=bool(bases))
            stored, damaged = read_verified(folder.path)
            segments, recovery = _recover(folder, bases, max_record, stored, damaged)
        except BaseException:
            folder.close()
            raise
        verified = VerifiedEndFile(folder.path, stored, fsync_folder=folder.fsync)
        last = segments[-1]
        verified_end = recovery.verified_end
        try:
            if recovery.distrusted is not None:
                # What the file held is worthless: replace both slots with what was just checked.
                verified.reset(last.end, tail_crc(last.fd, last.base, last.end))
                verified_end = last.end
            elif last.end - verified_end >= checkpoint_bytes:
                verified.save(last.end, tail_crc(last.fd, last.base, last.end))
                verified_end = last.end
        except OSError as error:
            _logger.warning("log %s: cannot save its verified end %d: %s", folder.path, last.end, error)
        except BaseException:
            verified.close()
            for segment in segments:
                segment.close()
            folder.close()
            raise
        return cls(
            folder,
            segments,
            segment_size=segment_size,
            max_record=max_record,
            verified=verified,
            verified_end=verified_end,
            recovery=recovery,
            checkpoint_bytes=checkpoint_bytes,
        )

    # --------------------------------------------------------------- properties

    @property
    def directory(self) -> Path:
        return self._folder.path

    @property
    def segment_size(self) -> int:
        return self._segment_size

    @property
    def max_record(self) -> int:
        return self._max_record

    @property
    def start_offset(self) -> int:
        """The first offset still held (older segments were deleted)."""
        return self._index[0][0]

    @property
    def end_offset(self) -> int:
        """Where the next append goes; every byte below it is a whole, readable record."""
        return self._end

    @property
    def flushed_offset(self) -> int:
        """Every byte below this has been fsynced."""
        return self._flushed

    @property
    def verified_end(self) -> int:
        """The saved verified end: the next open checks only the records after it."""
        return self._verified_end

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        """An fsync (or the cut after a failed write) failed: appends are refused (see ``drop_unflushed``)."""
        return self._failure is not None

    def segments(self) -> list[tuple[int, int]]:
        """``(first offset, length)`` of each segment, oldest first (for status tools)."""
        return [(s.base, s.size) for s in self._index[1]]

    # ---------------------------------------------------------------- appending

    def append(self, data: bytes | bytearray | memoryview, *, at: int | None = None) -> int:
        """Append whole records (a batch the caller has checked) in one write.

        Returns the offset of the batch's first byte. On a failed write the
        segment is cut back to where it was and ``LogIOError`` is raised. ``at``:
        the offset the batch must start at (a replica copying its master's bytes);
        ``OffsetBeyondEnd`` if the log ends elsewhere, checked under the append lock.
        """
        size = len(data)
        if size == 0:
            raise ValueError("data is empty: append takes one or more whole records")
        with self._append_lock:
            self._check_usable()
            if at is not None and at != self._end:
                raise OffsetBeyondEnd(
                    f"the batch is for offset {at} but the log ends at {self._end}", at, self.start_offset, self._end
                )
            if size > self._max_record + HEADER_SIZE:
                self._check_record_sizes(data)
            segment = self._active
            if segment.size and segment.size + size > self._segment_size:
                segment = self._roll()
            offset = segment.end
            self._write(segment, data, offset)
            segment.size += size
            if self._recent is not None and at is None:  # not a replica's copy: read back with CRCs
                self._recent.add(offset, data)
            self._end = offset + size  # publish only once the bytes are written
            return offset

    def append_record(self, kind: int, payload: bytes | bytearray | memoryview) -> int:
        """Wrap ``payload`` in an envelope and append it; returns its offset."""
        if len(payload) > self._max_record:
            raise RecordTooLarge(f"record payload of {len(payload)} bytes exceeds max_record {self._max_record}")
        return self.append(encode(kind, payload))

    def flush(self) -> int:
        """fsync what has been appended; returns the new ``flushed_offset``."""
        with self._flush_lock:
            self._check_usable()
            target = self._end
            if target <= self._flushed:
                return self._flushed
            # Read target before the active segment: a roll in between has
            # already fsynced the segment holding target (under this lock).
            segment = self._active
            self._fsync(segment, target)
            self._flushed = target
            if target - max(self._verified_end, self._verified_tried) >= self._checkpoint_bytes:
                self._save_verified(segment, target)
            return target

    def _save_verified(self, segment: _Segment, end: int) -> None:
        """Save ``end`` (flushed, in ``segment``) as the verified end (under the flush lock).

        A failure costs only a longer check at the next open: logged once, tried again later.
        """
        self._verified_tried = end
        try:
            self._verified.save(end, tail_crc(segment.fd, segment.base, end))
        except OSError as error:
            if not self._verified_failing:
                self._verified_failing = True
                _logger.warning(
                    "log %s: cannot save its verified end %d (the next open checks more of the last segment): %s",
                    self._folder.path,
                    end,
                    error,
                )
            return
        if self._verified_failing:
            self._verified_failing = False
            _logger.info("log %s: verified end saved again (%d)", self._folder.path, end)
        self._verified_end = end

    def drop_unflushed(self) -> int:
        """Cut what was appended past ``flushed_offset`` and take appends again; returns the bytes cut.

        For an owner that tells no one of an append before its flush (the ``sync``
        writer), after a failed fsync (a full disk) or a failed cut of a failed
        write: those bytes were acknowledged to nobody, and the kernel may have
        dropped their pages, so the log carries on from its last good flush
        rather than refusing every later append. Nobody may have read past
        ``flushed_offset`` (the scheduler's replay and the realtime index do not).
        """
        with self._append_lock, self._flush_lock:
            if self._closed:
                raise LogClosed(f"log {self._folder.path} is closed")
            segment = self._active
            keep = self._flushed - segment.base
            if keep < 0:  # cannot happen: a roll flushes the segment it leaves
                raise LogFailed(f"log {self._folder.path}: unflushed bytes before the active segment")
            cut = self._end - self._flushed
            try:
                os.ftruncate(segment.fd, keep)
            except OSError as error:
                self._failure = error
                raise LogIOError(
                    f"cannot cut segment {segment.path.name} back to offset {self._flushed}: {error}"
                ) from error
            segment.size = keep
            self._end = self._flushed
            self._failure = None
            if self._recent is not None:
                self._recent.clear()
            return cut

    def truncate(self, offset: int) -> int:
        """Cut the log back to ``offset`` (a record start, or the end) and fsync; returns the bytes cut.

        For a replica whose tail its new master never had (replication): the bytes
        were never acknowledged as replicated. Segments wholly past ``offset`` are
        deleted; the one holding it becomes the active segment. Nobody may be reading
        past ``offset`` (the scheduler's replay checkpoint must be at or below it).
        """
        with self._append_lock, self._flush_lock:
            if self._closed:
                raise LogClosed(f"log {self._folder.path} is closed")
            if offset >= self._end:
                if offset > self._end:
                    raise OffsetBeyondEnd(
                        f"offset {offset} is past the end of the log", offset, self.start_offset, self._end
                    )
                return 0
            bases, segments = self._index
            if offset < bases[0]:
                raise OffsetDeleted(
                    f"offset {offset} lies before the first retained offset {bases[0]}", offset, bases[0], self._end
                )
            if offset not in bases:
                self.read(offset)  # raises NotRecordStart unless a record starts there
            keep = bisect_right(bases, offset) - 1
            if keep and bases[keep] == offset:
                keep -= 1  # the previous segment stays active, ending at offset
            cut = self._end - offset
            held = segments[keep]
            if self._verified_end > offset:
                # Lowered first: bytes appended at these offsets later are not the ones it vouched for.
                try:
                    self._verified.save(offset, tail_crc(held.fd, held.base, offset))
                except OSError as error:
                    raise LogIOError(
                        f"cannot lower the verified end of log {self._folder.path} to {offset} "
                        f"before cutting it back: {error}"
                    ) from error
                self._verified_end = self._verified_tried = offset
            try:
                for segment in segments[keep + 1 :]:
                    segment.close()
                    segment.path.unlink(missing_ok=True)
                os.ftruncate(held.fd, offset - held.base)
                os.fsync(held.fd)
                self._folder.fsync()
            except OSError as error:
                self._failure = error
                raise LogIOError(f"cannot cut log {self._folder.path} back to offset {offset}: {error}") from error
            held.size = offset - held.base
            if self._recent is not None:
                self._recent.clear()
            with self._index_lock:
                self._index = (bases[: keep + 1], segments[: keep + 1])
            self._active = held
            self._end = offset
            self._flushed = offset  # the held segment was fsynced above, earlier ones at their roll
            _logger.warning("log %s: cut %d byte(s) back to offset %d", self._folder.path, cut, offset)
            return cut

    def _write(self, segment: _Segment, data: bytes | bytearray | memoryview, offset: int) -> None:
        try:
            pwrite_all(segment.fd, data, segment.size, path=segment.path)
        except OSError as error:
            try:
                os.ftruncate(segment.fd, segment.size)
            except OSError as cut_error:
                self._failure = cut_error
            raise LogIOError(
                f"append of {len(data)} bytes at offset {offset} to segment {segment.path.name} failed: {error}"
            ) from error

    def _fsync(self, segment: _Segment, target: int) -> None:
        try:
            os.fsync(segment.fd)
        except OSError as error:
            # The kernel may have dropped the dirty pages: nothing after the last
            # good flush can be trusted, so refuse to go on.
            self._failure = error
            raise LogIOError(f"fsync of segment {segment.path.name} up to offset {target} failed: {error}") from error

    def roll(self) -> bool:
        """Start a new segment at the end now; False if the active segment is empty.

        The active segment is fsynced first, as a roll by size does. Segments are
        deleted whole and never the active one, so a writer whose load is too small
        to fill a segment rolls to let what it no longer needs be deleted. Blocking.
        """
        with self._append_lock:
            self._check_usable()
            if not self._active.size:
                return False
            self._roll()
            return True

    def _roll(self) -> _Segment:
        """Start a new segment at the current end (called under the append lock)."""
        old = self._active
        with self._flush_lock:
            self._fsync(old, old.end)  # only the last segment may ever have a torn tail
            self._flushed = max(self._flushed, old.end)
        base = old.end
        path = self._folder.path / segment_name(base)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise LogIOError(f"cannot create segment {path}: {error}") from error
        try:
            self._folder.fsync()
        except OSError as error:
            # Not ours yet: remove it, so the next roll (once space is back) can create it.
            os.close(fd)
            path.unlink(missing_ok=True)
            raise LogIOError(f"cannot create segment {path}: {error}") from error
        segment = _Segment(base, path, fd, 0)
        with self._index_lock:
            bases, segments = self._index
            self._index = ([*bases, base], [*segments, segment])
        self._active = segment
        _logger.debug("log %s: new segment %s", self._folder.path, path.name)
        return segment

    def _check_record_sizes(self, data: bytes | bytearray | memoryview) -> None:
        # Only a batch big enough to hold an oversize record gets here. A record
        # over max_record would be cut off as corrupt by the next recovery.
        view = memoryview(data).cast("B")
        position = 0
        while position + HEADER_SIZE <= len(view):
            payload_size = HEADER.unpack_from(view, position)[0]
            if payload_size > self._max_record:
                raise RecordTooLarge(
                    f"record at batch byte {position} has a payload of {payload_size} bytes; "
                    f"max_record is {self._max_record}"
                )
            position += HEADER_SIZE + payload_size

    def _check_usable(self) -> None:
        if self._closed:
            raise LogClosed(f"log {self._folder.path} is closed")
        if self._failure is not None:
            raise LogFailed(
                f"log {self._folder.path} refuses appends after an earlier failure "
                f"({self._failure}); reopen it to recover"
            )

    # ------------------------------------------------------------------ reading

    def keep_recent(self, limit: int) -> None:
        """From now on keep about the last ``limit`` bytes appended in memory, for ``read_recent``.

        Only batches this process made and checked: a replica's copy of its master's bytes
        (``append(at=...)``) is not kept, so reading it goes through ``read_raw`` and its CRCs."""
        if self._recent is None:
            self._recent = RecentBytes(limit)
        else:
            self._recent.limit = limit

    def read_recent(self, offset: int, length: int) -> bytes | None:
        """The bytes ``[offset, offset + length)`` if this process appended them lately and keeps
        them in memory (``keep_recent``), else None: read them with ``read_raw`` (blocking).

        Not a system call, so the event loop may call it. The bytes are the ones written (their
        records checked by whoever appended them), so no CRC is checked again."""
        recent = self._recent
        return recent.read(offset, length) if recent is not None else None

    def read_recent_many(self, spans: list[tuple[int, int]]) -> list[bytes | None]:
        """``read_recent`` of each ``(offset, length)`` in one call (None for each if nothing is kept)."""
        recent = self._recent
        return recent.read_many(spans) if recent is not None else [None] * len(spans)

    def read_recent_whole(self, offset: int, end: int, max_bytes: int) -> bytes | None:
        """Whole records from ``offset`` (a record boundary) up to a batch end within
        ``min(end, offset + max_bytes)`` (at least one batch, never past ``end``), if this
        process appended them lately and keeps them (``keep_recent``); else None. As
        ``read_recent``: no system call, no CRC checked again (``RecentBytes.read_whole``)."""
        recent = self._recent
        return recent.read_whole(offset, end, max_bytes) if recent is not None else None

    def read(self, offset: int) -> Record:
        """The record starting at ``offset``."""
        segment, limit = self._locate(offset)
        if offset >= limit:
            raise OffsetBeyondEnd(f"offset {offset} is at or past the end of the log", offset, self.start_offset, limit)
        buf, span = self._read_first(segment, offset, limit)
        return Record(offset, span.kind, buf[HEADER_SIZE : span.end], offset + span.end)

    def read_raw(self, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]:
        """Whole records from ``offset``, about ``max_bytes`` of them, and the offset after.

        Returns ``(b"", offset)`` at the end of the log. The records come from one
        segment; call again from the returned offset for more. The first record is
        returned whole even if it is bigger than ``max_bytes``, so a reader always
        moves on.
        """
        buf, spans = self._read_chunk(offset, max_bytes)
        if not spans:
            return b"", offset
        end = spans[-1].end
        return (buf if end == len(buf) else buf[:end]), offset + end

    def iter_from(self, offset: int, *, chunk_size: int = 1 << 20) -> Iterator[Record]:
        """Every record from ``offset`` to the end, across segments, read ``chunk_size`` at a time.

        The start is checked now; the iteration follows appends made while it runs.
        """
        self._locate(offset)
        return self._iter_records(offset, chunk_size)

    def _iter_records(self, offset: int, chunk_size: int) -> Iterator[Record]:
        position = offset
        while True:
            buf, spans = self._read_chunk(position, chunk_size)
            if not spans:
                return
            for start, end, kind in spans:
                yield Record(position + start, kind, buf[start + HEADER_SIZE : end], position + end)
            position += spans[-1].end

    def _locate(self, offset: int) -> tuple[_Segment, int]:
        """The segment holding ``offset`` and how far it may be read (``offset <= end``)."""
        if self._closed:
            raise LogClosed(f"log {self._folder.path} is closed")
        end = self._end  # read before the index: the index then covers end
        bases, segments = self._index
        if offset > end:
            raise OffsetBeyondEnd(f"offset {offset} is past the end of the log", offset, bases[0], end)
        if offset < bases[0]:
            raise OffsetDeleted(
                f"offset {offset} lies before the first retained offset {bases[0]}: its segment was deleted",
                offset,
                bases[0],
                end,
            )
        segment = segments[bisect_right(bases, offset) - 1]
        return segment, min(end, segment.end)

    def _read_first(self, segment: _Segment, offset: int, limit: int) -> tuple[bytes, Span]:
        available = limit - offset
        buf = os.pread(segment.fd, min(available, _FIRST_READ), offset - segment.base)
        try:
            return buf, next(iter_spans(buf, max_payload=self._max_record))
        except TruncatedRecord as truncated:
            # Header checks passed and the payload runs past what we read: fetch it whole.
            problem: EnvelopeError = truncated
            needed = HEADER_SIZE + HEADER.unpack_from(buf)[0] if len(buf) >= HEADER_SIZE else 0
            if len(buf) < needed <= available:
                buf = os.pread(segment.fd, needed, offset - segment.base)
                try:
                    return buf, next(iter_spans(buf, max_payload=self._max_record))
                except EnvelopeError as again:
                    problem = again
            raise self._not_record_start(offset, problem) from None
        except CorruptRecord as error:
            raise self._not_record_start(offset, error) from None

    def _read_chunk(self, offset: int, max_bytes: int) -> tuple[bytes, list[Span]]:
        segment, limit = self._locate(offset)
        if offset >= limit:
            return b"", []
        buf = os.pread(segment.fd, min(max(max_bytes, 1), limit - offset), offset - segment.base)
        spans: list[Span] = []
        try:
            spans.extend(iter_spans(buf, max_payload=self._max_record))
        except EnvelopeError:
            # The chunk ended inside a record (fine: stop before it), or a record
            # is bad; a bad one at the start is reported by _read_first below, one
            # further on when the caller reads from there.
            if not spans:
                buf, span = self._read_first(segment, offset, limit)
                spans.append(span)
        return buf, spans

    def _not_record_start(self, offset: int, error: EnvelopeError) -> NotRecordStart:
        return NotRecordStart(
            f"offset {offset} is not the start of an intact record: {error.reason}",
            offset,
            self.start_offset,
            self._end,
        )

    # ----------------------------------------------------------------- deleting

    def delete_before(self, offset: int) -> int:
        """Delete the segments whose every record lies below ``offset``; returns how many.

        The active (last) segment is never deleted. Oldest go first, so a crash
        midway leaves a contiguous log.
        """
        if self._closed:
            raise LogClosed(f"log {self._folder.path} is closed")
        with self._index_lock:
            bases, segments = self._index
            count = 0
            while count < len(segments) - 1 and segments[count].end <= offset:
                count += 1
            if not count:
                return 0
            doomed = segments[:count]
            self._index = (bases[count:], segments[count:])
        for segment in doomed:
            segment.path.unlink()
        self._folder.fsync()
        _logger.info(
            "log %s: deleted %d segment(s) below offset %d (%s .. %s)",
            self._folder.path,
            count,
            doomed[-1].end,
            doomed[0].path.name,
            doomed[-1].path.name,
        )
        return count

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Flush (unless an earlier failure forbids it) and release the folder."""
        if self._closed:
            return
        try:
            if self._failure is None:
                self.flush()
        finally:
            with self._append_lock, self._flush_lock, self._index_lock:
                self._closed = True
                if self._recent is not None:
                    self._recent.clear()
                for segment in self._index[1]:
                    segment.close()
                self._verified.close()
                self._folder.close()

    def __enter__(self) -> SegmentedLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SegmentedLog {self._folder.path} [{self.start_offset}, {self._end}) flushed={self._flushed}>"


def _recover(
    folder: DataFolder, bases: list[int], max_record: int, stored: VerifiedEnd | None, damaged: int
) -> tuple[list[_Segment], Recovery]:
    """Open the segment files, cut a torn tail after the verified end, drop empty trailing segments."""
    distrusted = f"{damaged} slot(s) of its verified-end file do not check" if damaged and stored is None else None
    if not bases:
        path = folder.path / segment_name(0)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        folder.fsync()
        return [_Segment(0, path, fd, 0)], Recovery(0, 0, 0, distrusted)
    segments: list[_Segment] = []
    vouched = stored.end if stored is not None else 0
    checked = cut = 0
    warned = False
    try:
        for base in bases:
            path = folder.path / segment_name(base)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            segments.append(_Segment(base, path, fd, os.fstat(fd).st_size))
        while True:
            last = segments[-1]
            start = 0
            if stored is not None and vouched > last.base:
                if vouched > last.end:
                    problem = f"it lies past the end of segment {last.path.name} ({last.end})"
                elif tail_crc(last.fd, last.base, vouched) != stored.tail_crc:
                    problem = f"the bytes below it in segment {last.path.name} are not the ones it vouched for"
                else:
                    problem = None
                    start = vouched - last.base
                if problem is not None:
                    distrusted = f"verified end {vouched}: {problem}"
                    vouched = 0
            if distrusted is not None and not warned and last.size:
                warned = True
                _logger.warning(
                    "log %s: %s; checking all %d byte(s) of segment %s",
                    folder.path,
                    distrusted,
                    last.size,
                    last.path.name,
                )
            valid, error = _valid_end(last.fd, last.size, max_record, start)
            checked += last.size - start
            if error is not None:
                _logger.warning(
                    "log %s: segment %s: cut %d byte(s) from offset %d: %s; every record before it is intact",
                    folder.path,
                    last.path.name,
                    last.size - valid,
                    last.base + valid,
                    error.reason,
                )
                os.ftruncate(last.fd, valid)
                cut += last.size - valid
                last.size = valid
            if last.size or len(segments) == 1:
                break
            # An empty segment after another one holds nothing: the previous one
            # becomes active again (offsets do not move, its end is this base).
            _logger.info("log %s: removing empty last segment %s", folder.path, last.path.name)
            last.close()
            last.path.unlink()
            segments.pop()
        folder.fsync()
        for before, after in zip(segments, segments[1:]):
            if before.end != after.base:
                raise CorruptLog(
                    f"log {folder.path}: segment {before.path.name} ends at offset {before.end} "
                    f"but the next segment starts at {after.base}; a segment is missing, cut "
                    "short or overlapping, and recovery only repairs the last segment"
                )
        os.fsync(segments[-1].fd)  # what a previous process wrote is durable from here on
    except BaseException:
        for segment in segments:
            segment.close()
        raise
    if checked:
        _logger.info(
            "log %s: checked %d byte(s) of segment %s after its verified end %d",
            folder.path,
            checked,
            segments[-1].path.name,
            vouched,
        )
    return segments, Recovery(vouched, checked, cut, distrusted)


def _valid_end(fd: int, size: int, max_record: int, start: int = 0) -> tuple[int, EnvelopeError | None]:
    """How far a segment file holds intact records from ``start`` (a record start), and why it stops there."""
    position = start
    chunk = _SCAN_CHUNK
    while position < size:
        buf = os.pread(fd, min(chunk, size - position), position)
        if not buf:
            break
        good = 0
        try:
            for span in iter_spans(buf, max_payload=max_record):
                good = span.end
        except TruncatedRecord as error:
            if position + len(buf) >= size:
                return position + good, error
            # The chunk, not the file, ended: go on from the cut record, with a
            # bigger chunk if a single record did not fit.
            chunk = chunk * 2 if good == 0 else _SCAN_CHUNK
        except CorruptRecord as error:
            return position + good, error
        else:
            good = len(buf)
        position += good
    return position, None
