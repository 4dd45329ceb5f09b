"""Pull logs: one per consumer of a group and subject.

A pull log lists, in order, the consume-log sequences handed to one consumer, so
the consumer's progress is one number, its acked position in its own pull log,
whatever other consumers of the group took. An entry (16 bytes, big-endian)::

    offset size  field
    0      8     sequence      u64  consume-log sequence handed out
    8      2     redeliveries  u16  times the group had it back before this hand-out
    10     2     reserved      u16  0
    12     4     crc           u32  CRC-32 of bytes 0..12

Entry *n* (the pull-log sequence *n*) sits at byte ``n * 16`` of
``pull/<stem>.log``; ``pull/<stem>.json`` names the subject, group and consumer
(and whether it reads as a broadcast consumer). The lmdb state holds the
committed length. Entries past it are hand-outs made after the last checkpoint:
a PULL is answered only after its entries are written (to the page cache), so
after a crash of the process they say exactly what was handed out, and recovery
keeps them (``read_tail``) instead of handing those messages out again as new.

The consumer's progress in it is a ``delaymq.protocol.ranges.AckRanges``: the
acked position plus the acked (or given back) ranges above it.

A pull log of a consumer in memory keeps its descriptor open between writes (a
PULL is one ``pwrite``; the checkpoint fsyncs that descriptor): ``OpenPullLogs``
opens them lazily and closes the least recently used past ``OPEN_PULL_LOGS``, so
many consumers never exhaust the descriptors of the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from delaymq.realtime.consumelog import write_small_file
from delaymq.realtime.openfiles import OpenFiles
from delaymq.storage.files import pwrite_all

PULL_ENTRY = struct.Struct(">QHHI")
PULL_ENTRY_SIZE = PULL_ENTRY.size  # 16
PULL_VERSION = 1
PULL_FORMAT = {"format": "pull-log", "version": PULL_VERSION, "entry_size": PULL_ENTRY_SIZE}
_BODY = struct.Struct(">QHH")

#: Pull logs of one server holding an open descriptor at most (the least recently written
#: are closed past it; a checkpoint in flight may keep one more open a little longer).
OPEN_PULL_LOGS = 256


def encode_pull_entries(sequences: Iterable[int], redeliveries: Iterable[int]) -> bytes:
    out = bytearray()
    pack = _BODY.pack
    crc32 = zlib.crc32
    for sequence, count in zip(sequences, redeliveries, strict=True):
        body = pack(sequence, count, 0)
        out += body
        out += crc32(body).to_bytes(4, "big")
    return bytes(out)


def decode_pull_entries(data: bytes, *, prefix: bool = False) -> tuple[list[int], list[int]]:
    """Sequences and redelivery counts of whole entries; a bad CRC raises ValueError
    (``prefix``: ends the entries instead)."""
    sequences: list[int] = []
    counts: list[int] = []
    view = memoryview(data)
    for index, (sequence, count, _reserved, crc) in enumerate(
        PULL_ENTRY.iter_unpack(data[: len(data) - len(data) % PULL_ENTRY_SIZE])
    ):
        start = index * PULL_ENTRY_SIZE
        if zlib.crc32(view[start : start + 12]) != crc:
            if prefix:
                break
            raise ValueError(f"pull-log entry {index} of the block does not check")
        sequences.append(sequence)
        counts.append(count)
    return sequences, counts


def consumer_stem(subject: str, group: str, consumer: str) -> str:
    """The file name stem of a consumer's pull log (and its key in the state store)."""
    key = "\0".join((subject, group, consumer)).encode()
    return hashlib.blake2b(key, digest_size=16, person=b"dq-consumer").hexdigest()


class PullLog:
    """One consumer's pull-log file.

    With ``files`` (a consumer in memory) its descriptor stays open between writes, within
    the bound of ``files``; without (recovery, a slave applying progress) each write opens
    and closes the file. Only the event loop opens and closes the descriptor; ``flush``
    (a worker thread) uses it under ``_lock``, so it is never closed under an fsync.
    """

    def __init__(self, directory: Path, stem: str, *, files: OpenPullLogs | None = None) -> None:
        self.path = directory / f"{stem}.log"
        self._names = directory / f"{stem}.json"
        self.created = False
        self.files = files
        self._fd = -1
        self._lock = threading.Lock()

    def create(self, subject: str, group: str, consumer: str, *, broadcast: bool = False) -> None:
        """Write the names file if this is a new pull log (fsynced by the checkpoint)."""
        if self._names.exists():
            return
        names = {"subject": subject, "group": group, "consumer": consumer, "broadcast": broadcast}
        write_small_file(self._names, json.dumps(names).encode())
        self.created = True

    def read_names(self) -> dict[str, Any] | None:
        """The names file (``subject``, ``group``, ``consumer``, ``broadcast``), or None if unreadable."""
        try:
            names = json.loads(self._names.read_bytes())
        except (OSError, ValueError):
            return None
        if not isinstance(names, dict) or not all(
            isinstance(names.get(key), str) for key in ("subject", "group", "consumer")
        ):
            return None
        return names

    def read_tail(self, start: int) -> tuple[list[int], list[int]]:
        """The entries from ``start`` to the first that does not check (start-up, blocking).

        Past the committed length a crash (of the machine) may leave a torn or
        unwritten entry: what comes before it is kept.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return [], []
        try:
            size = os.fstat(fd).st_size
            if size <= start * PULL_ENTRY_SIZE:
                return [], []
            data = os.pread(fd, size - start * PULL_ENTRY_SIZE, start * PULL_ENTRY_SIZE)
        finally:
            os.close(fd)
        return decode_pull_entries(data, prefix=True)

    def write(self, position: int, data: bytes) -> None:
        """Write entries at pull-log sequence ``position`` (page cache; fsync in ``flush``)."""
        files = self.files
        if files is not None and not files.closed:
            pwrite_all(files.fd(self), data, position * PULL_ENTRY_SIZE, path=self.path)
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            pwrite_all(fd, data, position * PULL_ENTRY_SIZE, path=self.path)
        finally:
            os.close(fd)

    def read(self, start: int, stop: int) -> tuple[list[int], list[int]]:
        """Entries ``[start, stop)``; blocking (a worker thread, or at start-up)."""
        if stop <= start:
            return [], []
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, (stop - start) * PULL_ENTRY_SIZE, start * PULL_ENTRY_SIZE)
        finally:
            os.close(fd)
        if len(data) != (stop - start) * PULL_ENTRY_SIZE:
            raise ValueError(f"pull log {self.path} ends before entry {stop}")
        return decode_pull_entries(data)

    def truncate(self, length: int) -> bool:
        """Cut entries past ``length`` (a consumer loaded after start-up, whose tail recovery did
        not keep; a slave's entries the master never had); True if there were any."""
        fd = self._fd
        if fd >= 0:  # held open (the event loop): the next write goes on at ``length``
            if os.fstat(fd).st_size > length * PULL_ENTRY_SIZE:
                os.ftruncate(fd, length * PULL_ENTRY_SIZE)
                return True
            return False
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size > length * PULL_ENTRY_SIZE:
            os.truncate(self.path, length * PULL_ENTRY_SIZE)
            return True
        return False

    def flush(self) -> bool:
        """fsync (blocking: a worker thread); True if the folder needs an fsync too.

        The open descriptor when there is one (no open by path); ``_lock`` keeps the
        event loop from closing it meanwhile (it defers the close instead)."""
        with self._lock:
            fd = self._fd
            if fd >= 0:
                os.fsync(fd)
            else:
                _fsync_path(self.path)
        if self.created:
            _fsync_path(self._names)
        created, self.created = self.created, False
        return created

    def _open(self) -> int:
        """The descriptor, opened if need be (the event loop; through ``OpenPullLogs``)."""
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return self._fd

    def _close(self, *, wait: bool = False) -> bool:
        """Close the descriptor (the event loop); False if a ``flush`` holds it now and not ``wait``."""
        if self._fd < 0:
            return True
        if not self._lock.acquire(blocking=wait):
            return False
        try:
            fd, self._fd = self._fd, -1
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor is released all the same; the data is in the page cache
        finally:
            self._lock.release()
        return True


class OpenPullLogs(OpenFiles):
    """The pull logs holding a descriptor, least recently written first: at most ``limit``
    (``delaymq.realtime.openfiles``; the consume logs have their own). Event loop only."""

    def __init__(self, limit: int = OPEN_PULL_LOGS) -> None:
        super().__init__(limit)


def _fsync_path(path: Path) -> None:
    """fsync a file by name (blocking); nothing if it is not there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_pull_logs(directory: Path) -> list[str]:
    """The stems of the pull logs in ``directory``."""
    return sorted(name[:-4] for name in os.listdir(directory) if name.endswith(".log"))


__all__ = [
    "OPEN_PULL_LOGS",
    "PULL_ENTRY_SIZE",
    "PULL_FORMAT",
    "OpenPullLogs",
    "PullLog",
    "consumer_stem",
    "decode_pull_entries",
    "encode_pull_entries",
    "list_pull_logs",
]
