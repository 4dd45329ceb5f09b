"""The bytes last appended to a log, kept in memory so the newest records are read without the disk.

A realtime server hands most records out within moments of storing them: a PULL
that finds them here needs no file read and no worker thread. The owner of a log
turns it on (``SegmentedLog.keep_recent``); the log remembers each batch it wrote,
in offset order and end to end, and forgets the oldest past ``limit`` bytes, and
everything when it cuts its tail (what was cut may be written again differently).

Thread-safe: a worker thread appends while the event loop reads.
"""

from __future__ import annotations

import threading
from bisect import bisect_right

Bytes = bytes | bytearray | memoryview
#: ``read_many`` reads at most this many spans per lock.
_MANY = 256


class RecentBytes:
    """The last ``limit`` bytes (at least the last batch) appended at contiguous offsets."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"the recent bytes' limit must be positive, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._chunks: list[bytes] = []
        self._first = 0  # chunks before this index are forgotten (compacted now and then)
        self._size = 0

    def __len__(self) -> int:
        """Bytes held."""
        return self._size

    def add(self, base: int, data: Bytes) -> None:
        """``data`` was written at ``base``; a gap from the last chunk starts afresh."""
        chunk = data if isinstance(data, bytes) else bytes(data)
        with self._lock:
            bases, chunks = self._bases, self._chunks
            if len(bases) > self._first and bases[-1] + len(chunks[-1]) != base:
                self._clear()
            bases.append(base)
            chunks.append(chunk)
            self._size += len(chunk)
            first = self._first
            while self._size > self.limit and first < len(chunks) - 1:
                self._size -= len(chunks[first])
                first += 1
            if first > 64 and first * 2 > len(chunks):
                del bases[:first], chunks[:first]
                first = 0
            self._first = first

    def read(self, offset: int, length: int) -> bytes | None:
        """The bytes ``[offset, offset + length)``, or None unless all of them are held."""
        with self._lock:
            return self._read(offset, length)

    def read_many(self, spans: list[tuple[int, int]]) -> list[bytes | None]:
        """``read`` of each ``(offset, length)``, a lock per ``_MANY`` of them (a loader reads
        thousands; an append waits for one lock's worth at most)."""
        read = self._read
        out: list[bytes | None] = []
        for first in range(0, len(spans), _MANY):
            with self._lock:
                out += [read(offset, length) for offset, length in spans[first : first + _MANY]]
        return out

    def _read(self, offset: int, length: int) -> bytes | None:
        bases, chunks, first = self._bases, self._chunks, self._first
        if len(bases) <= first or offset < bases[first]:
            return None
        index = bisect_right(bases, offset, first) - 1
        chunk = chunks[index]
        start = offset - bases[index]
        stop = start + length
        if stop <= len(chunk):
            return chunk[start:stop] if start or stop != len(chunk) else chunk
        parts = [chunk[start:]]
        needed = stop - len(chunk)
        while needed > 0:
            index += 1
            if index >= len(chunks):
                return None
            chunk = chunks[index]
            parts.append(chunk[:needed])
            needed -= len(chunk)
        return b"".join(parts)

    def read_whole(self, offset: int, end: int, max_bytes: int) -> bytes | None:
        """Bytes from ``offset`` (a record boundary) to the end of a batch (so whole records):
        the last batch end at or below ``min(end, offset + max_bytes)``, or the first one past
        ``offset`` if that is further (a reader always moves on); never past ``end``. None
        unless all of them are held (or there is no batch end in ``(offset, end]``)."""
        with self._lock:
            bases, chunks, first = self._bases, self._chunks, self._first
            if len(bases) <= first or offset < bases[first]:
                return None
            index = bisect_right(bases, offset, first) - 1
            stop_index = index
            stop = bases[index] + len(chunks[index])  # the first batch end past offset
            if stop > end or stop <= offset:
                return None
            budget = min(end, offset + max_bytes)
            while stop_index + 1 < len(chunks):
                after = bases[stop_index + 1] + len(chunks[stop_index + 1])
                if after > budget:
                    break
                stop_index += 1
                stop = after
            start = offset - bases[index]
            if stop_index == index:
                chunk = chunks[index]
                return chunk[start:] if start else chunk
            return b"".join([chunks[index][start:], *chunks[index + 1 : stop_index + 1]])

    def clear(self) -> None:
        """Forget everything (the log cut its tail, or closed)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._bases.clear()
        self._chunks.clear()
        self._first = 0
        self._size = 0


__all__ = ["RecentBytes"]
