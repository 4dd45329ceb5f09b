"""The commit's writes: a replay step's staged bytes into its hours' schedule logs and
delay indexes, made durable; and, on abort, those files cut back.

Each hour's log bytes and index bytes go out with one ``pwrite`` each, at the ends the
hour's committed summary gives (``StagedHour.committed_log_end`` and
``committed_entries``), so a step that is not committed leaves at most entries beyond
the summary, which recovery checks. Few hours: each file is fdatasynced, with the heads
tables the previous step wrote. Many hours (``_SYNCFS_FROM_HOURS``): one ``syncfs(2)``
of the folder's file system costs less than thousands of fsyncs. A new hour gets an
empty heads table and a folder fsync.

``ScheduleStore.commit`` calls ``append`` before its lmdb transaction; readers of these
files are ``HourLog`` (committed entries only) and recovery.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterable

from delaymq.scheduler.delayindex import ENTRY_SIZE
from delaymq.scheduler.fsyncdurations import fsync_clock
from delaymq.scheduler.headstable import HeadsTables
from delaymq.scheduler.hours import INDEX_SUFFIX, LOG_SUFFIX, hour_name
from delaymq.scheduler.staging import StagedHour
from delaymq.storage.files import pwrite_all
from delaymq.storage.folder import DataFolder

_SYNCFS_FROM_HOURS = 8  # a commit syncing this many hours' files or more syncs the file system once


class ScheduleFiles:
    """The schedule logs and delay indexes of one schedule folder, as replay writes them.

    Used by the thread holding the store's write lock. ``fsyncs`` and ``syncfs_calls``
    count what it made durable, for the store's statistics; each is timed into the
    tables' ``fsync_durations`` (one histogram for filing).
    """

    def __init__(self, folder: DataFolder, tables: HeadsTables, *, fsync: bool) -> None:
        self._folder = folder
        self._tables = tables
        self._fsync = fsync
        self.fsyncs = 0  # file and folder fsyncs
        self.syncfs_calls = 0  # whole file-system syncs

    def append(self, written: list[StagedHour]) -> None:
        """Append each hour's staged bytes to its files (an empty heads table for a new
        hour) and make them durable, with the heads slots the previous step wrote."""
        prefix = str(self._folder.path) + os.sep
        tables = self._tables
        hours = tables.unsynced().union(w.hour for w in written)
        whole_fs = self._fsync and len(hours) >= _SYNCFS_FROM_HOURS and syncfs is not None
        per_file = self._fsync and not whole_fs
        created = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        for w in written:
            w.end_run()
            name = hour_name(w.hour)
            if w.committed_entries == 0:
                created = True
                tables.create(w.hour)
            for suffix, data, position in (
                (LOG_SUFFIX, b"".join(w.parts), w.committed_log_end),
                (INDEX_SUFFIX, w.index, w.committed_entries * ENTRY_SIZE),
            ):
                path = prefix + name + suffix
                fd = os.open(path, flags, 0o644)
                try:
                    pwrite_all(fd, data, position, path=path)
                    if per_file:
                        started = fsync_clock()
                        os.fdatasync(fd)
                        tables.fsync_durations.since(started)
                        self.fsyncs += 1
                finally:
                    os.close(fd)
        if whole_fs:
            assert syncfs is not None
            started = fsync_clock()
            syncfs(self._folder)
            tables.fsync_durations.since(started)
            self.syncfs_calls += 1
            tables.synced()
        else:
            tables.sync()  # fdatasync each (nothing with fsync off)
            if per_file and created:
                started = fsync_clock()
                self._folder.fsync()
                tables.fsync_durations.since(started)
                self.fsyncs += 1

    def cut_back(self, staged: Iterable[StagedHour]) -> OSError | None:
        """Cut each hour's files back to their committed ends; the last error that left a
        file uncut (the store then refuses filing until reopened), None if all were cut."""
        failure: OSError | None = None
        for w in staged:
            name = hour_name(w.hour)
            for suffix, size in (
                (LOG_SUFFIX, w.committed_log_end),
                (INDEX_SUFFIX, w.committed_entries * ENTRY_SIZE),
            ):
                try:
                    os.truncate(self._folder.path / (name + suffix), size)
                except FileNotFoundError:
                    pass
                except OSError as error:
                    failure = error
        return failure


def _find_syncfs() -> Callable[[DataFolder], None] | None:
    """``syncfs(2)`` of the folder's file system (Linux), or None where it is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.syncfs
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int]

    def syncfs(folder: DataFolder) -> None:
        fd = os.open(folder.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if call(fd) != 0:
                errno = ctypes.get_errno()
                raise OSError(errno, f"syncfs of {folder.path} failed: {os.strerror(errno)}")
        finally:
            os.close(fd)

    return syncfs


#: ``syncfs(2)`` of a data folder's file system, None where the platform has none.
syncfs = _find_syncfs()


__all__ = ["ScheduleFiles", "syncfs"]
