"""Consume logs: one per subject, fixed-size entries pointing into the message log.

Entry *n* of a subject sits at byte ``n * ENTRY_SIZE`` of its file, so a subject
is read like an array and an entry's number is its consume-log sequence. An entry
(32 bytes, big-endian)::

    offset size  field
    0      8     offset     u64  where the record starts in the message log
    8      4     size       u32  bytes of the whole record (envelope included)
    12     8     tag_mask   u64  OR of ``tag_bit(tag)`` over the record's tags
    20     8     stored_at  i64  epoch ms UTC at which the server indexed it; with bit 62
                                 (``HELD``) set, the record came ahead of its
                                 ``deliver_at`` and the other bits say from when a PULL
                                 may hand it out (``held_until``)
    28     4     crc        u32  CRC-32 of bytes 0..28

The file of subject *s* is ``consume/<stem>.log`` with ``stem =
blake2b(s, digest_size=16).hex()``; ``consume/<stem>.name`` holds *s* in UTF-8,
so a reader from outside can find a subject's file without the server.

A consume log is derived data: the message log is the truth and the index step
rebuilds what a crash tore (``ConsumeLog.add`` checks an entry already on disk
past the checkpoint instead of writing it twice; ``finish_recovery`` cuts what
replay did not confirm). Writes go to the page cache from the event loop (one
small ``pwrite`` per subject per indexed batch); fsync runs in a worker thread at
checkpoints.

Reads for PULL come from memory, never from the file on the event loop: a log
keeps the entries it wrote last (its *tail*, up to ``TAIL_ENTRIES``) and a
*window* of older entries a worker thread read for a consumer that lags
(``read`` then ``hold_window``); ``read_held`` and ``held_entry`` answer from
those or say they cannot. The indexer bounds how many logs hold either
(``delaymq.realtime.index``).

A log keeps its file descriptor only while it is in use: the indexer's ``OpenFiles``
(``delaymq.realtime.openfiles``) closes the least recently written past
``OPEN_CONSUME_LOGS``, and a log opens it again on its next write; a worker thread's
read or fsync of a log without one opens the file by its path. So a server with many
subjects holds a bounded number of descriptors. A log opened without ``files`` (tools,
tests) holds its descriptor until ``close``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from itertools import starmap
from pathlib import Path
from typing import NamedTuple, TypeVar

from delaymq.realtime.openfiles import OpenFiles
from delaymq.storage.errors import CorruptLog
from delaymq.storage.files import pwrite_all

_T = TypeVar("_T")

#: Entries a log keeps in memory after writing them (its tail), and a window holds at most.
TAIL_ENTRIES = 2048
#: Consume logs of one indexer holding an open descriptor at most (``OpenFiles``).
OPEN_CONSUME_LOGS = 256
ENTRY = struct.Struct(">QIQqI")
ENTRY_SIZE = ENTRY.size  # 32
ENTRY_VERSION = 1
_BODY = struct.Struct(">QIQq")  # the CRC-covered part
_CRC = struct.Struct(">I")
CONSUME_FORMAT = {"format": "consume-log", "version": ENTRY_VERSION, "entry_size": ENTRY_SIZE}


#: Bit 62 of an entry's time: the record came ahead of its ``deliver_at`` (a scheduler sending
#: ahead) and the rest of the time is when a PULL may hand it out. Without it the time is when
#: the server indexed the record, and a PULL hands it out at once, even if the wall clock has
#: stepped back since (the flag, not the time, says what to hold).
HELD = 1 << 62


def held_until(stored_at: int) -> int | None:
    """When the entry of time ``stored_at`` may be handed out, if it is held back; else None."""
    return stored_at ^ HELD if stored_at & HELD else None


def entry_time(stored_at: int) -> int:
    """An entry's time in epoch ms, without the ``HELD`` flag: when it was indexed, or when it is due."""
    return stored_at & ~HELD


class Entry(NamedTuple):
    """One decoded consume-log entry."""

    offset: int
    size: int
    tag_mask: int
    stored_at: int


def encode_entry(offset: int, size: int, tag_mask: int, stored_at: int) -> bytes:
    body = _BODY.pack(offset, size, tag_mask, stored_at)
    return body + _CRC.pack(zlib.crc32(body))


def decode_entry(data: bytes | bytearray | memoryview, position: int = 0) -> Entry | None:
    """The entry at ``data[position:]``, or None when its CRC does not check."""
    offset, size, mask, stored_at, crc = ENTRY.unpack_from(data, position)
    if zlib.crc32(memoryview(data)[position : position + 28]) != crc:
        return None
    return Entry(offset, size, mask, stored_at)


def iter_entries(data: bytes | bytearray) -> Iterator[tuple[int, int, int, int, int]]:
    """``(offset, size, tag_mask, stored_at, crc)`` for each whole entry in ``data``.

    No CRC check: for reading entries this server wrote and recovery verified.
    """
    end = len(data) - len(data) % ENTRY_SIZE
    return ENTRY.iter_unpack(data[:end] if end != len(data) else data)


def subject_stem(subject: str) -> str:
    """The file name stem of a subject's consume log (names of any length fit)."""
    return hashlib.blake2b(subject.encode(), digest_size=16).hexdigest()


class ConsumeLog:
    """One subject's consume log file. Built by ``open``; the indexer appends."""

    def __init__(
        self, subject: str, path: Path, fd: int, count: int, on_disk: int, *, files: OpenFiles | None = None
    ) -> None:
        self.subject = subject
        self.path = path
        self._fd = fd  # -1 while ``files`` has closed it
        #: Keeps the descriptor within its bound (None: held until ``close``).
        self.files = files
        #: Held by a worker thread's read or fsync and by closing: the owner never closes
        #: the descriptor under them (its number could be reused by another open meanwhile).
        self._in_use = threading.Lock()
        self.count = count  # entries held, pending ones included
        self._written = count  # entries in the file and confirmed
        self._on_disk = on_disk  # entries in the file, confirmed or not (recovery)
        self._pending = bytearray()
        self.created = False  # a new file whose name and folder entry await a fsync
        # Entries [_tail_start, _written) in memory, and a window read for a lagging consumer.
        self._tail = bytearray()
        self._tail_start = count
        self._window_start = 0
        self._window = b""
        self._generation = 0  # moves whenever entries below _written may change (window reads check it)

    @classmethod
    def open(
        cls, directory: Path, subject: str, *, checkpoint_count: int = 0, files: OpenFiles | None = None
    ) -> ConsumeLog:
        """Open or create ``subject``'s log; entries past ``checkpoint_count`` are unconfirmed.

        Unconfirmed entries are kept if replay produces the same ones (``add``),
        so entries already handed to consumers keep their numbers and times.
        With ``files`` its descriptor is one of those ``files`` bounds.
        """
        stem = subject_stem(subject)
        path = directory / f"{stem}.log"
        name_path = directory / f"{stem}.name"
        created = not path.exists()
        if created:
            write_small_file(name_path, subject.encode())
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            size = os.fstat(fd).st_size
            on_disk = size // ENTRY_SIZE
            if on_disk < checkpoint_count:
                raise CorruptLog(
                    f"consume log {path} of subject {subject!r} holds {on_disk} entries but "
                    f"the checkpoint says {checkpoint_count} were fsynced"
                )
            if size % ENTRY_SIZE:
                os.ftruncate(fd, on_disk * ENTRY_SIZE)  # a torn last entry
        except BaseException:
            os.close(fd)
            raise
        log = cls(subject, path, fd, checkpoint_count, on_disk, files=files)
        log.created = created
        if files is not None and files.closed:
            log._close()  # opened late (see ``_use``): nothing would close it
        elif files is not None:
            files.fd(log)  # the most recently used now: the least recently used may close
        return log

    # ---------------------------------------------------------------- descriptor

    def _use(self, call: Callable[[int], _T]) -> _T:
        """``call`` with the descriptor, for the owner's own calls (writes, recovery), opened if
        need be. Once the owner closed ``files`` (a master stepped down while a SEND's append was
        in flight, whose index step comes late) with the file opened and closed for the call."""
        files = self.files
        if files is None:
            return call(self._fd)
        if not files.closed:
            return call(files.fd(self))
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            return call(fd)
        finally:
            os.close(fd)

    def _open(self) -> int:
        """Open the descriptor if ``files`` closed it (the owner; through ``files``)."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        return self._fd

    def _close(self, *, wait: bool = False) -> bool:
        """Close the descriptor (the owner); False if a worker thread uses it now and not ``wait``."""
        if self._fd < 0:
            return True
        if wait:
            with self._in_use:
                self._close_now()
            return True
        if not self._in_use.acquire(blocking=False):
            return False
        try:
            self._close_now()
        finally:
            self._in_use.release()
        return True

    def _close_now(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass  # released all the same; what was written is in the page cache

    def _pread(self, size: int, position: int) -> bytes:
        """Read with the descriptor, or (closed by ``files``) the file opened by path: a worker thread."""
        with self._in_use:
            if self._fd >= 0:
                return os.pread(self._fd, size, position)
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return os.pread(fd, size, position)
            finally:
                os.close(fd)

    # ---------------------------------------------------------------- writing

    def add(self, offset: int, size: int, tag_mask: int, stored_at: int) -> None:
        """Add the next entry (written by ``write_pending``).

        During recovery the entry already on disk at this position is kept when
        it describes the same record, so replay never renumbers an entry.
        """
        if self._on_disk > self._written:
            position = self._written * ENTRY_SIZE
            found = self._use(lambda fd: os.pread(fd, ENTRY_SIZE, position))
            old = decode_entry(found.ljust(ENTRY_SIZE, b"\0"))
            if old is not None and old.offset == offset and old.size == size:
                self._written += 1
                self.count += 1
                self._forget_held()
                return
            self._use(lambda fd: os.ftruncate(fd, position))
            self._on_disk = self._written
        self._pending += encode_entry(offset, size, tag_mask, stored_at)
        self.count += 1

    def add_many(self, entries: list[tuple[int, int, int, int]]) -> None:
        """``add`` each ``(offset, size, tag_mask, stored_at)``: an index step's entries of this
        subject, encoded in one loop (recovery, re-checking entries on disk, takes them one by one)."""
        if self._on_disk > self._written:
            for entry in entries:
                self.add(*entry)
            return
        self._pending += b"".join(starmap(encode_entry, entries))
        self.count += len(entries)

    def write_pending(self) -> None:
        """Write the added entries in one ``pwrite`` (to the page cache)."""
        if not self._pending:
            return
        written = self._written
        pending, path = self._pending, self.path
        self._use(lambda fd: pwrite_all(fd, pending, written * ENTRY_SIZE, path=path))
        tail = self._tail
        if self._tail_start + len(tail) // ENTRY_SIZE != written:
            tail.clear()
            self._tail_start = written
        tail += self._pending
        if len(tail) > 2 * TAIL_ENTRIES * ENTRY_SIZE:
            cut = len(tail) - TAIL_ENTRIES * ENTRY_SIZE
            del tail[:cut]
            self._tail_start += cut // ENTRY_SIZE
        self._written = self.count
        self._on_disk = self.count
        self._pending = bytearray()

    def take_back(self, count: int) -> None:
        """Forget the entries from ``count`` on, pending or written: their index step failed (disk full).

        Written ones stay in the file unconfirmed, as after a crash: ``add``
        confirms them when the step is retried, or cuts them.
        """
        self._pending = bytearray()
        self.count = count
        self._written = min(self._written, count)
        self._on_disk = max(self._on_disk, self._written)
        self._forget_held()

    def finish_recovery(self) -> None:
        """Cut entries past the checkpoint that replay did not confirm."""
        self.write_pending()
        if self._on_disk > self._written:
            length = self._written * ENTRY_SIZE
            self._use(lambda fd: os.ftruncate(fd, length))
            self._on_disk = self._written
        self._forget_held()

    def clamp(self, count: int) -> None:
        """Forget entries from ``count`` on (their records are gone from the message log)."""
        if count < self.count:
            self.write_pending()
            self._use(lambda fd: os.ftruncate(fd, count * ENTRY_SIZE))
            self.count = self._written = self._on_disk = count
            self._forget_held()

    def flush(self) -> bool:
        """fsync (blocking: run in a worker thread); True if the folder needs one too.

        Without a descriptor (closed by ``files``) the file is opened by its path: an fsync
        makes the file's data durable, whichever descriptor wrote it."""
        with self._in_use:
            if self._fd >= 0:
                os.fsync(self._fd)
            else:
                _fsync_path(self.path)
        if not self.created:
            return False
        _fsync_path(self.path.with_suffix(".name"))
        self.created = False
        return True

    # ---------------------------------------------------------------- reading

    def read(self, start: int, count: int) -> bytes:
        """Up to ``count`` raw entries from sequence ``start`` (fewer at the end)."""
        stop = min(self._written, start + count)
        if stop <= start:
            return b""
        return self._pread((stop - start) * ENTRY_SIZE, start * ENTRY_SIZE)  # (a worker thread)

    def read_held(self, start: int, count: int) -> bytes | bytearray | None:
        """``read`` from memory (the tail, or the window) without a system call: up to ``count``
        entries from ``start`` (at least one if ``start`` is below the end), or None if memory
        does not hold entry ``start``: read it with ``read`` in a worker thread, then ``hold_window``."""
        stop = min(self._written, start + count)
        if stop <= start:
            return b""
        if start >= self._tail_start:
            tail_start = self._tail_start
            return self._tail[(start - tail_start) * ENTRY_SIZE : (stop - tail_start) * ENTRY_SIZE]
        window_start = self._window_start
        window_stop = window_start + len(self._window) // ENTRY_SIZE
        if window_start <= start < window_stop:
            stop = min(stop, window_stop)
            return self._window[(start - window_start) * ENTRY_SIZE : (stop - window_start) * ENTRY_SIZE]
        return None

    def held_entry(self, sequence: int) -> Entry | None:
        """``entry`` from memory, or None if memory does not hold it (see ``read_held``)."""
        if not 0 <= sequence < self._written:
            raise IndexError(f"consume log of {self.subject!r} has no entry {sequence} (count {self._written})")
        data = self.read_held(sequence, 1)
        if data is None:
            return None
        entry = decode_entry(data)
        if entry is None:
            raise CorruptLog(f"consume log {self.path}: entry {sequence} does not check")
        return entry

    @property
    def generation(self) -> int:
        """Changes whenever held entries are forgotten (read it before a window's ``read``)."""
        return self._generation

    def hold_window(self, start: int, data: bytes, generation: int) -> None:
        """Keep entries ``read`` from ``start`` (in a worker thread) for ``read_held``; ignored if the
        log forgot what it held since ``generation`` (an index step was taken back meanwhile)."""
        if generation == self._generation:
            self._window_start = start
            self._window = data[: max(0, self._written - start) * ENTRY_SIZE]

    def release(self) -> None:
        """Give the memory of the tail and the window back (the log is idle)."""
        self._tail = bytearray()
        self._tail_start = self._written
        self._window = b""

    def _forget_held(self) -> None:
        self._generation += 1
        self._tail.clear()
        self._tail_start = self._written
        self._window = b""

    def entry(self, sequence: int) -> Entry:
        """One entry, CRC checked."""
        if not 0 <= sequence < self._written:
            raise IndexError(f"consume log of {self.subject!r} has no entry {sequence} (count {self._written})")
        entry = decode_entry(self._pread(ENTRY_SIZE, sequence * ENTRY_SIZE).ljust(ENTRY_SIZE, b"\0"))
        if entry is None:
            raise CorruptLog(f"consume log {self.path}: entry {sequence} does not check")
        return entry

    def close(self) -> None:
        """Close the file, after a worker thread's read or fsync in progress (a master stepping
        down with requests in flight): one waits here, briefly, rather than use a closed number."""
        if self.files is not None:
            self.files.forget(self, wait=True)
        else:
            self._close(wait=True)


def write_small_file(path: Path, data: bytes) -> None:
    """A small file written whole; the checkpoint fsyncs it and its folder."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_subjects(directory: Path) -> dict[str, str]:
    """Subject of each consume log in ``directory`` (stem -> subject)."""
    subjects: dict[str, str] = {}
    for name in os.listdir(directory):
        if name.endswith(".log"):
            stem = name[:-4]
            try:
                subject = (directory / f"{stem}.name").read_bytes().decode()
            except (FileNotFoundError, UnicodeDecodeError):
                subject = ""
            if subject_stem(subject) == stem:
                subjects[stem] = subject
            else:
                # Created by a crashed run whose name file never reached the disk:
                # no checkpoint can point into it (a checkpoint fsyncs the name
                # first), and replay recreates it.
                os.unlink(directory / name)
    return subjects


__all__ = [
    "CONSUME_FORMAT",
    "ENTRY_SIZE",
    "OPEN_CONSUME_LOGS",
    "ConsumeLog",
    "Entry",
    "HELD",
    "decode_entry",
    "encode_entry",
    "entry_time",
    "held_until",
    "iter_entries",
    "list_subjects",
    "subject_stem",
    "write_small_file",
]
