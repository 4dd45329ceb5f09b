"""Second-heads tables in one small file per hour, changed only through a redo journal.

Each hour holding entries has ``YYYYMMDDHH.heads``: its 3,600 heads slots, slot ``s``
at byte ``8 * s``, each the second's newest entry number (i32) and count (u32),
big-endian. A count of 0 is an empty second whatever the newest field holds, so a new
table is a sparse file of zeros.

Why files and not lmdb keys: replay files into every hour of the backlog at once (a
month of uniformly spread messages touches all 720 hours in every step). With one lmdb
key per non-empty second, each step's write transaction dirtied most leaf pages of a
B-tree that grows with the backlog; lmdb keeps the memory of a transaction's dirty
pages for reuse, and the map pages it touches stay resident. A table file is read and
written with ``pread``/``pwrite`` of the slots a step needs: nothing of it is mapped
or cached, whatever the backlog.

Crash safety (docs/scheduler-storage.md): slots change only as a **journal** says.
A journal (``delayindex.pack_journal``: hour u32, second u16, newest i32, count u32
per slot) is committed in lmdb (``REPLAY_DB``, key ``JOURNAL_KEY``) in the same
transaction as the entry counts and the replay checkpoint it goes with, and only then
written to the
tables (``HeadsTables.write``). Before a transaction replaces the journal, the slots the
previous one wrote are made durable (``HeadsTables.sync``, or one ``syncfs``). So after
a crash every slot holds its value of the last commit, except perhaps the slots that
commit's journal names, and writing that journal again (``redo``) repairs them: the
tables and the lmdb state agree exactly, as when the heads lived in lmdb. Recovery
(``recovery.recover_hours``) does that redo first (``redo``: only the slots a table does
not hold yet are written, and the journal's hours are left for the next sync, which
comes before the journal is replaced); an hour whose table is missing or cut short has
it rebuilt from its delay index.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from delaymq.scheduler.delayindex import HEAD, Heads, Slots
from delaymq.scheduler.fsyncdurations import FsyncDurations, fsync_clock
from delaymq.scheduler.hours import HEADS_SUFFIX, SECONDS_PER_HOUR, CorruptSchedule, hour_name
from delaymq.storage.files import pwrite_all

#: The bytes of one hour's table.
TABLE_BYTES = SECONDS_PER_HOUR * HEAD.size
_TABLE = struct.Struct(">" + "iI" * SECONDS_PER_HOUR)
_EMPTY = bytes(HEAD.size)  # an empty slot, as in a new (sparse) table
_SYNCFS_FROM = 8  # syncing this many tables or more: one syncfs instead


def heads_from_table(hour: int, data: bytes) -> Heads:
    """A ``Heads`` from the bytes of a whole table."""
    values = _TABLE.unpack(data)
    counts = list(values[1::2])
    newest = [n if c else -1 for n, c in zip(values[0::2], counts)]
    return Heads(hour, newest, counts, sum(counts))


class HeadsTables:
    """The heads tables of one schedule folder.

    Thread use: one writer (replay, recovery, repairs) calls ``create``/``write``/``sync``;
    readers may call ``read``/``newest`` from other threads meanwhile. A reader sees an
    hour's table either before or after a ``write``, never half of one (one lock).
    """

    def __init__(self, directory: Path, *, fsync: bool, syncfs: Callable[[], None] | None = None) -> None:
        self._prefix = str(directory) + os.sep
        self._fsync = fsync
        self._syncfs = syncfs  # syncfs(2) of the folder's file system, where there is one
        self._lock = threading.Lock()
        self._unsynced: set[int] = set()  # hours written or created since the last sync
        self.fsyncs = 0
        self.syncfs_calls = 0
        self.fsync_durations = FsyncDurations()  # each fsync and syncfs of filing (ScheduleFiles' too)

    def path(self, hour: int) -> str:
        return self._prefix + hour_name(hour) + HEADS_SUFFIX

    def exists(self, hour: int) -> bool:
        """The hour has a whole table."""
        try:
            return os.stat(self.path(hour)).st_size == TABLE_BYTES
        except FileNotFoundError:
            return False

    def create(self, hour: int) -> None:
        """An empty table for ``hour`` if it has none (durable at the next ``sync``; the
        caller fsyncs the folder)."""
        fd = os.open(self.path(hour), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size != TABLE_BYTES:
                os.ftruncate(fd, TABLE_BYTES)
        finally:
            os.close(fd)
        self._unsynced.add(hour)

    def read(self, hour: int) -> Heads | None:
        """The whole table of ``hour``, or None if it has no whole table."""
        try:
            fd = os.open(self.path(hour), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            with self._lock:
                data = os.pread(fd, TABLE_BYTES + 1, 0)
        finally:
            os.close(fd)
        return heads_from_table(hour, data) if len(data) == TABLE_BYTES else None

    def read_slot(self, hour: int, second: int, open_tables: dict[int, int]) -> int:
        """``(newest + 1) << 32 | count`` of one slot, 0 if empty. Through ``open_tables``
        (hour -> fd, the caller's: opened here at its first use, closed by ``close_all``), so
        a replay step reading many slots of one hour opens its table once."""
        fd = open_tables.get(hour)
        if fd is None:
            fd = open_tables[hour] = self._open_existing(self.path(hour), hour, os.O_RDONLY)
        newest, count = self._read_head(fd, hour, second)
        return (newest + 1) << 32 | count if count else 0

    @staticmethod
    def close_all(open_tables: dict[int, int]) -> None:
        """Close the files ``read_slot`` opened into ``open_tables``, and empty it."""
        for fd in open_tables.values():
            os.close(fd)
        open_tables.clear()

    def newest(self, hour: int, second: int) -> int:
        """The newest entry of ``second`` as the table says, -1 for none."""
        fd = self._open_existing(self.path(hour), hour, os.O_RDONLY)
        try:
            newest, count = self._read_head(fd, hour, second)
        finally:
            os.close(fd)
        return newest if count else -1

    def _read_head(self, fd: int, hour: int, second: int) -> tuple[int, int]:
        """``(newest, count)`` of one slot of the table open as ``fd``."""
        with self._lock:
            data = os.pread(fd, HEAD.size, second * HEAD.size)
        if len(data) != HEAD.size:
            raise CorruptSchedule(f"{self.path(hour)} is cut short: no slot for second {second}")
        newest, count = HEAD.unpack(data)
        return newest, count

    def write(self, slots: Slots) -> None:
        """Write the slots of a committed journal into their tables (which must exist).
        Adjacent slots go out in one ``pwrite``; each hour under the lock, whole."""
        by_hour: dict[int, list[int]] = {}
        for key in slots:
            by_hour.setdefault(key >> 12, []).append(key)
        pack = HEAD.pack
        for hour, keys in by_hour.items():
            keys.sort()
            path = self.path(hour)
            fd = self._open_existing(path, hour, os.O_WRONLY)
            try:
                with self._lock:
                    i = 0
                    while i < len(keys):
                        j = i + 1
                        while j < len(keys) and keys[j] == keys[j - 1] + 1:
                            j += 1
                        data = b"".join(
                            pack((value >> 32) - 1, value & 0xFFFF_FFFF) if value else _EMPTY
                            for value in map(slots.__getitem__, keys[i:j])
                        )
                        pwrite_all(fd, data, (keys[i] & 0xFFF) * 8, path=path)
                        i = j
            finally:
                os.close(fd)
            self._unsynced.add(hour)

    def redo(self, slots: Slots, names: Mapping[int, str]) -> tuple[int, set[int]]:
        """Write a committed journal's ``slots`` again where a table does not hold them.

        A slot write updates the file's times (a journal transaction of the file system
        each), so the tables are read first and only the slots that differ are written: a
        restart after a clean stop or after the journal was written out writes none.
        Every table the journal names is marked unsynced all the same, since what it holds
        may not have reached the disk; the next ``sync`` (before the journal is replaced)
        makes it durable. ``names`` gives hours' file names (``hour_name`` otherwise).
        Hours without a whole table are skipped. Returns the slots written and the hours
        whose table was found.
        """
        by_hour: dict[int, list[int]] = {}
        for key in slots:
            by_hour.setdefault(key >> 12, []).append(key)
        stale: dict[int, int] = {}
        found: set[int] = set()
        pack, unpack = HEAD.pack, HEAD.unpack
        for hour, keys in by_hour.items():
            name = names.get(hour)
            path = self._prefix + name + HEADS_SUFFIX if name is not None else self.path(hour)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                with self._lock:
                    table = os.pread(fd, TABLE_BYTES + 1, 0)
            finally:
                os.close(fd)
            if len(table) != TABLE_BYTES:
                continue
            found.add(hour)
            for key in keys:
                value = slots[key]
                start = (key & 0xFFF) * 8
                held = table[start : start + 8]
                if value:
                    differs = held != pack((value >> 32) - 1, value & 0xFFFF_FFFF)
                else:  # an empty second: any slot with count 0
                    differs = unpack(held)[1] != 0
                if differs:
                    stale[key] = value
        if stale:
            self.write(stale)
        self._unsynced.update(found)
        return len(stale), found

    def unsynced(self) -> frozenset[int]:
        """The hours whose table was written or created since the last sync."""
        return frozenset(self._unsynced)

    def sync(self) -> None:
        """Make every table written or created since the last sync durable: fdatasync
        each, or one ``syncfs`` for many."""
        if self._fsync and self._syncfs is not None and len(self._unsynced) >= _SYNCFS_FROM:
            started = fsync_clock()
            self._syncfs()
            self.fsync_durations.since(started)
            self.syncfs_calls += 1
        elif self._fsync:
            for hour in sorted(self._unsynced):
                try:
                    fd = os.open(self.path(hour), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:  # deleted since
                    continue
                try:
                    started = fsync_clock()
                    os.fdatasync(fd)
                    self.fsync_durations.since(started)
                finally:
                    os.close(fd)
                self.fsyncs += 1
        self._unsynced.clear()

    def synced(self) -> None:
        """The caller made every table durable (``syncfs``)."""
        self._unsynced.clear()

    def remove(self, hour: int) -> None:
        self._unsynced.discard(hour)
        try:
            os.unlink(self.path(hour))
        except FileNotFoundError:
            pass

    def _open_existing(self, path: str, hour: int, flags: int) -> int:
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CorruptSchedule(
                f"{path} is missing: the heads table of an hour with entries; run rebuild_heads({hour})"
            ) from None


__all__ = ["TABLE_BYTES", "HeadsTables", "heads_from_table"]
