"""The read side of a segmented log: the segment index, where the log ends, reads by offset.

``SegmentedLog`` (``delaymq.storage.log``) is a ``ReadableLog`` that also appends,
flushes and cuts. Reads take no lock: the appending thread publishes ``_end`` only
after its write has returned, and replaces the segment index whole, never mutating
it, so a reader's snapshot of ``(_end, _index)`` is always consistent.
"""

from __future__ import annotations

import os
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from delaymq.protocol.envelope import (
    HEADER,
    HEADER_SIZE,
    CorruptRecord,
    EnvelopeError,
    Span,
    TruncatedRecord,
    iter_spans,
)
from delaymq.storage.errors import LogClosed, NotRecordStart, OffsetBeyondEnd, OffsetDeleted
from delaymq.storage.folder import DataFolder
from delaymq.storage.recent import RecentBytes
from delaymq.storage.segment import Segment

_FIRST_READ = 4096  # read() fetches this much first, then the rest of a big record


class Record(NamedTuple):
    """One record read back: where it starts, its kind and payload, and where the next starts."""

    offset: int
    kind: int
    payload: bytes
    next_offset: int


class ReadableLog:
    """Reads of a segmented log by offset; ``SegmentedLog`` adds the writes. Use ``SegmentedLog.open``."""

    def __init__(self, folder: DataFolder, segments: list[Segment], *, max_record: int) -> None:
        self._folder = folder
        self._max_record = max_record
        # (bases, segments): replaced as a whole under SegmentedLog's index lock, read without a lock.
        self._index: tuple[list[int], list[Segment]] = ([s.base for s in segments], segments)
        self._end = segments[-1].end
        self._closed = False
        self._recent: RecentBytes | None = None  # see keep_recent

    @property
    def directory(self) -> Path:
        return self._folder.path

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
    def closed(self) -> bool:
        return self._closed

    def segments(self) -> list[tuple[int, int]]:
        """``(first offset, length)`` of each segment, oldest first (for status tools)."""
        return [(s.base, s.size) for s in self._index[1]]

    # ----------------------------------------------------- bytes kept in memory

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

    # ------------------------------------------------------------ reading files

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

    def _locate(self, offset: int) -> tuple[Segment, int]:
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

    def _read_first(self, segment: Segment, offset: int, limit: int) -> tuple[bytes, Span]:
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
