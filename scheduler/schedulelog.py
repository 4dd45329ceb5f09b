"""The schedule store: hourly schedule logs, their delay indexes and heads, dispatch logs.

One folder (``schedule/``) holds, per UTC hour that has messages, three files named by
the hour (``YYYYMMDDHH``, see ``delaymq.scheduler.hours``):

- ``YYYYMMDDHH.log``: the **schedule log**, the hour's message records end to end,
  byte for byte as they were in the message log (envelope records, CRC included);
- ``YYYYMMDDHH.index``: the **delay index**, 32-byte entries (``delaymq.scheduler.delayindex``);
- ``YYYYMMDDHH.dispatch``: the **dispatch log** (``delaymq.scheduler.dispatchlog``);
- ``YYYYMMDDHH.heads``: the **second-heads table** (``delaymq.scheduler.headstable``).

Each hour's committed summary, the replay **checkpoint** and the **heads journal** (the
new value of every heads slot the step changed) live in lmdb (the server's
``StateStore``; layout in ``delayindex``). One lmdb transaction moves them together;
the journal's slots are written to the heads tables after it, and written again by
recovery after a crash, so heads and checkpoint never disagree.

Memory stays flat however large the backlog: a step reads from the tables only the
heads slots of the seconds it files into and holds them until its commit; nothing of
the heads is kept between steps, and nothing of them is mapped.

Filing (``stage`` then ``commit``, driven by ``delaymq.scheduler.replay``): records are
staged per hour in memory (index entries packed into a bytearray, record bytes as
slices of the chunk read from the message log), then ``commit`` writes each hour's log
bytes and index bytes with one ``pwrite`` each, makes them durable (fdatasync per file,
or one ``syncfs`` when a step touched many hours) together with the heads slots the
previous step wrote, commits lmdb, and writes the step's heads slots. A crash before the
lmdb commit leaves entries beyond the committed summary: ``open`` checks them and keeps
the valid prefix (``delayindex.recover_hours``). Replay skips a record whose
message-log offset is not after its hour's last filed one, so re-reading from the
checkpoint files nothing twice.

Readers (the dispatcher) use ``open_hour`` -> ``HourLog`` from another thread while
replay files; they see committed entries only.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import struct
import threading
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from delaymq.protocol.envelope import HEADER_SIZE, RecordKind
from delaymq.protocol.records import RECORD_TIMES
from delaymq.scheduler.delayindex import (
    CHECKPOINT_KEY,
    DELETED_DB,
    ENTRY,
    ENTRY_BODY,
    ENTRY_CRC,
    ENTRY_SIZE,
    HOURS_DB,
    INDEX_VERSION,
    JOURNAL_KEY,
    JOURNAL_RECORD,
    MAX_ENTRIES,
    REPLAY_DB,
    Heads,
    HourSummary,
    IndexEntry,
    heads_from_index,
    hour_key,
    pack_journal,
    pread_all,
    read_entry,
    record_problem,
    recover_hours,
    table_slots,
)
from delaymq.scheduler.dispatchlog import DispatchLog
from delaymq.scheduler.headstable import TABLE_BYTES, HeadsTables
from delaymq.scheduler.hours import (
    DEFAULT_RETENTION_MS,
    DISPATCH_SUFFIX,
    HEADS_SUFFIX,
    HOUR_MS,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    MAX_DELIVER_AT,
    SECOND_MS,
    SECONDS_PER_HOUR,
    CorruptSchedule,
    HourNotComplete,
    HourOutOfRange,
    ScheduleError,
    check_hour,
    hour_name,
)
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import ensure_format
from delaymq.storage.state import StateStore

STORE_FORMAT = "schedule-store"
STORE_FORMAT_VERSION = 2  # 2: heads tables in files (version 1 kept them as lmdb keys)
#: Hours one replay step may file into: every hour of a two-year horizon and then some.
DEFAULT_MAX_STEP_HOURS = 20_000
DEFAULT_MAX_OPEN_DISPATCH_LOGS = 256

#: A step reading more slots of one hour than this reads its whole table at once.
_WHOLE_TABLE_FROM = 64
_MESSAGE = int(RecordKind.MESSAGE)
_READ_GAP = 64 << 10  # read_records reads across gaps up to this size in one pread
_READ_SPAN = 4 << 20  # ... into spans of at most this size
_SYNCFS_FROM_HOURS = 8  # a commit syncing this many hours' files or more syncs the file system once
_FORMAT = {
    "format": STORE_FORMAT,
    "version": STORE_FORMAT_VERSION,
    "index_version": INDEX_VERSION,
    "index_entry_size": ENTRY_SIZE,
    "hour_names": "YYYYMMDDHH UTC",
    "heads": f"YYYYMMDDHH{HEADS_SUFFIX} {TABLE_BYTES} bytes, journal in lmdb",
    "heads_journal_record": JOURNAL_RECORD.size,
    "dispatch_entry": "u32 big-endian",
}

_logger = logging.getLogger(__name__)


# --------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class HourArrivals:
    """The entries one replay step filed into one hour: numbers ``first_entry`` onwards,
    one per ``ms_in_hour`` value, in entry order."""

    hour: int
    first_entry: int
    ms_in_hour: array[int]

    def __len__(self) -> int:
        return len(self.ms_in_hour)

    def pairs(self) -> list[tuple[int, int]]:
        """``(ms_in_hour, entry_no)`` of each new entry, what ``SecondWheel.link`` takes."""
        return list(zip(self.ms_in_hour, range(self.first_entry, self.first_entry + len(self.ms_in_hour))))


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """What one committed replay step did.

    ``arrivals`` holds, per hour, the entries filed (tell the wheel: ``link`` into a
    loaded second, ``note_arrival`` otherwise; add the hour to the ``HourWheel``).
    ``new_hours`` are the hours that held no entry before.
    """

    start_offset: int  # message-log offset the step started at
    checkpoint: int  # message-log offset the next step starts at (saved)
    filed: int  # records filed into schedule logs
    already_filed: int  # records skipped: filed before a crash, not re-filed
    skipped: int  # records of another kind than MESSAGE
    bytes: int  # message-log bytes the step read
    arrivals: dict[int, HourArrivals] = field(default_factory=dict)
    new_hours: tuple[int, ...] = ()

    @property
    def idle(self) -> bool:
        """Nothing was read: replay is caught up with what the message log holds durably.
        (A step can file nothing yet move on, skipping records filed before a crash.)"""
        return self.checkpoint == self.start_offset


@dataclass(frozen=True, slots=True)
class ScheduleStoreStatistics:
    """A snapshot of the store's counters."""

    hours: int  # hours holding entries
    entries: int  # committed entries, all hours
    checkpoint: int
    steps: int  # replay steps committed since open
    filed: int  # records filed since open
    bytes_filed: int
    fsyncs: int  # file and folder fsyncs
    syncfs: int  # whole file-system syncs (commits that wrote many hours)
    heads_held: int  # heads slots in memory now: the current step's, 0 between steps
    heads_held_max: int  # the most heads slots one step held (bounded by the step, not the backlog)
    recovered_hours: int  # hours whose files open had to cut or roll forward


# --------------------------------------------------------------------- internals


class _Staging:
    """What the current replay step filed into one hour, until ``commit`` writes it."""

    __slots__ = (
        "hour",
        "key_base",
        "committed_entries",
        "committed_log_end",
        "first_source",
        "entries",
        "log_end",
        "last_source",
        "parts",
        "run_view",
        "run_start",
        "run_end",
        "index",
        "ms",
    )

    def __init__(self, hour: int, summary: HourSummary) -> None:
        self.hour = hour
        self.key_base = hour << 12  # heads-cache key of second s: key_base | s
        self.committed_entries = self.entries = summary.entries
        self.committed_log_end = self.log_end = summary.log_end
        self.first_source = summary.first_source
        self.last_source = summary.last_source
        self.parts: list[memoryview] = []  # record bytes, slices of the chunks read
        self.run_view: memoryview | None = None  # the run of adjacent records being grown
        self.run_start = 0
        self.run_end = 0
        self.index = bytearray()  # packed index entries
        self.ms = array("I")  # ms_in_hour of each new entry

    def end_run(self) -> None:
        if self.run_view is not None:
            self.parts.append(self.run_view[self.run_start : self.run_end])
            self.run_view = None


# --------------------------------------------------------------------- the store


class ScheduleStore:
    """The schedule folder of one scheduler. Use ``ScheduleStore.open``.

    Thread use: one thread at a time files (``stage``/``commit``, or ``replay_step``);
    readers (``open_hour``, ``heads``), dispatch-log calls and cleanup may run in
    other threads meanwhile.
    """

    def __init__(
        self,
        folder: DataFolder,
        state: StateStore,
        summaries: dict[int, HourSummary],
        checkpoint: int,
        *,
        tables: HeadsTables,
        max_step_hours: int,
        max_open_dispatch_logs: int,
        fsync: bool,
        recovered_hours: int,
    ) -> None:
        self._folder = folder
        self._state = state
        self._summaries = summaries
        self._checkpoint = checkpoint
        self._max_step_hours = max_step_hours
        self._max_open_dispatch_logs = max_open_dispatch_logs
        self._fsync = fsync
        self._tables = tables
        # The heads slots the current step files into: key hour << 12 | second, value
        # (newest + 1) << 32 | count (0: no entry). Read from the tables when the step
        # first touches a second, committed as the step's journal, dropped after it or
        # on abort: nothing of the heads stays in memory between steps.
        self._heads: dict[int, int] = {}
        self._heads_max = 0
        # Hours whose table was checked against their summary since open (one int per
        # hour with messages, like ``_summaries``).
        self._checked_hours: set[int] = set()
        self._staged: dict[int, _Staging] = {}
        self._step_filed = self._step_already = self._step_skipped = 0
        self._write_lock = threading.RLock()
        self._dispatch: OrderedDict[int, DispatchLog] = OrderedDict()
        self._dispatch_lock = threading.RLock()
        self._closed = False
        self._failure: BaseException | None = None
        self._steps = self._filed = self._bytes_filed = self._fsyncs = self._syncfs = 0
        self._recovered_hours = recovered_hours

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        state: StateStore,
        *,
        max_step_hours: int = DEFAULT_MAX_STEP_HOURS,
        max_open_dispatch_logs: int = DEFAULT_MAX_OPEN_DISPATCH_LOGS,
        fsync: bool = True,
    ) -> ScheduleStore:
        """Open (or create) the schedule folder, recovering every hour's files.

        ``state`` is the server's lmdb store (summaries, checkpoint, heads journal live there).
        ``max_step_hours`` caps the hours one replay step may file into (its memory);
        ``max_open_dispatch_logs`` how many dispatch logs stay open. ``fsync=False`` is
        for tests and benchmarks only.
        """
        for name, value in (
            ("max_step_hours", max_step_hours),
            ("max_open_dispatch_logs", max_open_dispatch_logs),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        folder = DataFolder(directory, what="schedule store")
        try:
            names = os.listdir(folder.path)
            suffixes = (LOG_SUFFIX, INDEX_SUFFIX, DISPATCH_SUFFIX, HEADS_SUFFIX)
            has_data = any(n.endswith(suffixes) for n in names)
            ensure_format(folder.path, _FORMAT, has_data=has_data)
            syncfs = None if _syncfs is None else partial(_syncfs, folder)
            tables = HeadsTables(folder.path, fsync=fsync, syncfs=syncfs)
            summaries, checkpoint, recovered = recover_hours(folder, state, names, tables)
        except BaseException:
            folder.close()
            raise
        return cls(
            folder,
            state,
            summaries,
            checkpoint,
            tables=tables,
            max_step_hours=max_step_hours,
            max_open_dispatch_logs=max_open_dispatch_logs,
            fsync=fsync,
            recovered_hours=recovered,
        )

    # ------------------------------------------------------------------ properties

    @property
    def directory(self) -> Path:
        return self._folder.path

    @property
    def state(self) -> StateStore:
        return self._state

    @property
    def checkpoint(self) -> int:
        """The message-log offset replay resumes from: every record below it is filed
        (and fsynced), so ``message_log.delete_before(checkpoint)`` is safe."""
        return self._checkpoint

    def hours_with_messages(self) -> list[int]:
        """The hours holding at least one committed entry, oldest first."""
        return sorted(self._summaries)

    def entries(self, hour: int) -> int:
        """How many committed entries ``hour`` holds (0 for an hour without files)."""
        summary = self._summaries.get(hour)
        return summary.entries if summary is not None else 0

    def statistics(self) -> ScheduleStoreStatistics:
        summaries = list(self._summaries.values())
        return ScheduleStoreStatistics(
            hours=len(summaries),
            entries=sum(s.entries for s in summaries),
            checkpoint=self._checkpoint,
            steps=self._steps,
            filed=self._filed,
            bytes_filed=self._bytes_filed,
            fsyncs=self._fsyncs + self._tables.fsyncs,
            syncfs=self._syncfs + self._tables.syncfs_calls,
            heads_held=len(self._heads),
            heads_held_max=self._heads_max,
            recovered_hours=self._recovered_hours,
        )

    def path_of(self, hour: int, suffix: str) -> Path:
        """The file of ``hour`` with ``suffix`` (``LOG_SUFFIX``, ``INDEX_SUFFIX``, ``DISPATCH_SUFFIX``,
        ``HEADS_SUFFIX``)."""
        return self._folder.path / (hour_name(hour) + suffix)

    # ------------------------------------------------------------------ filing

    def stage(self, buf: bytes, source: int, stop: int | None = None) -> int:
        """Stage the records of ``buf[:stop]`` (whole records, read from the message log at
        offset ``source``) for filing; returns how many bytes were consumed.

        Stops early, at a record boundary, before a record that would make this step
        file into more than ``max_step_hours`` hours: commit, then stage the rest. A
        ``deliver_at`` of 0 or below (immediate) files at the record's ``created_at``.
        Nothing touches the disk until ``commit``.
        """
        with self._write_lock:
            self._check_usable()
            try:
                return self._stage(buf, source, len(buf) if stop is None else stop)
            except BaseException:
                self._abort()
                raise

    def _stage(self, buf: bytes, source: int, stop: int) -> int:
        self._read_slots(self._slots_to_read(buf, stop))
        view = memoryview(buf)
        unpack = RECORD_TIMES.unpack_from
        pack_body = ENTRY_BODY.pack
        pack_crc = ENTRY_CRC.pack
        crc32 = zlib.crc32
        staged = self._staged
        heads = self._heads
        get_head = heads.get
        limit = self._max_step_hours
        filed = already = skipped = 0
        pos = 0
        try:
            while pos < stop:
                size, _magic, _version, kind, _crc, at, created = unpack(buf, pos)
                end = pos + HEADER_SIZE + size
                if end > stop:
                    raise ScheduleError(
                        f"record at message-log offset {source + pos} ends at {source + end}, "
                        f"past the end of what was given to stage ({source + stop})"
                    )
                if kind != _MESSAGE:
                    skipped += 1
                    pos = end
                    continue
                if at <= 0:
                    at = created if created > 0 else 0
                hour = at // HOUR_MS
                w = staged.get(hour)
                if w is None:
                    if len(staged) >= limit:
                        break
                    w = self._stage_hour(hour, at, source + pos)
                src = source + pos
                if src <= w.last_source:
                    already += 1
                    pos = end
                    continue
                n = w.entries
                if n >= MAX_ENTRIES:
                    raise ScheduleError(
                        f"hour {hour_name(hour)}: an hour holds at most {MAX_ENTRIES} entries (MAX_ENTRIES)"
                    )
                ms = at - hour * HOUR_MS
                key = w.key_base | ms // 1000
                head = get_head(key, 0)  # _read_slots put every stored non-empty slot there
                heads[key] = (n + 1) << 32 | ((head & 0xFFFF_FFFF) + 1)
                w.entries = n + 1
                length = end - pos
                body = pack_body(w.log_end, length, ms, (head >> 32) - 1, src)
                index = w.index
                index += body
                index += pack_crc(crc32(body))
                w.log_end += length
                if w.run_end == pos and w.run_view is view:
                    w.run_end = end
                else:
                    if w.run_view is not None:
                        w.parts.append(w.run_view[w.run_start : w.run_end])
                    w.run_view = view
                    w.run_start = pos
                    w.run_end = end
                w.ms.append(ms)
                w.last_source = src
                if w.first_source < 0:
                    w.first_source = src
                filed += 1
                pos = end
        finally:
            self._step_filed += filed
            self._step_already += already
            self._step_skipped += skipped
            if len(heads) > self._heads_max:
                self._heads_max = len(heads)
        return pos

    def _stage_hour(self, hour: int, at: int, src: int) -> _Staging:
        if not 0 <= hour <= (MAX_DELIVER_AT // HOUR_MS):
            raise HourOutOfRange(
                f"record at message-log offset {src}: deliver_at {at} is beyond {MAX_DELIVER_AT} "
                "(MAX_DELIVER_AT, 9999-12-31 UTC), the last hour a schedule log can be named for"
            )
        summary = self._summaries.get(hour)
        if summary is None:
            # A deleted hour filed again: the records it held before must not come back
            # (replay can go back past them after a repair), so start after them.
            tombstone = self._state.get(DELETED_DB, hour_key(hour))
            last = -1 if tombstone is None else int.from_bytes(tombstone, "big", signed=True)
            summary = HourSummary(0, 0, -1, last)
        w = self._staged[hour] = _Staging(hour, summary)
        return w

    def _slots_to_read(self, buf: bytes, stop: int) -> set[int]:
        """The heads slots (``hour << 12 | second``) the records ``_stage`` will file from
        ``buf[:stop]`` fall in and the step does not hold yet (stopping where it stops)."""
        unpack = RECORD_TIMES.unpack_from
        heads = self._heads
        hours = set(self._staged)
        limit = self._max_step_hours
        wanted: set[int] = set()
        pos = 0
        while pos < stop:
            size, _magic, _version, kind, _crc, at, created = unpack(buf, pos)
            end = pos + HEADER_SIZE + size
            if end > stop:
                break  # _stage refuses it
            if kind == _MESSAGE:
                if at <= 0:
                    at = created if created > 0 else 0
                hour = at // HOUR_MS
                if hour not in hours:
                    if len(hours) >= limit:
                        break
                    hours.add(hour)
                key = hour << 12 | (at - hour * HOUR_MS) // 1000
                if key not in heads:
                    wanted.add(key)
            pos = end
        return wanted

    def _read_slots(self, keys: set[int]) -> None:
        """Put the stored value of each non-empty slot of ``keys`` in the step's heads,
        one table at a time. The first read of an hour since open reads its whole table
        and checks it counts the hour's entries (lost or stale heads would link new
        entries wrongly)."""
        by_hour: dict[int, list[int]] = {}
        for key in keys:
            by_hour.setdefault(key >> 12, []).append(key & 0xFFF)
        heads = self._heads
        for hour, seconds in sorted(by_hour.items()):
            summary = self._summaries.get(hour)
            if summary is None or not summary.entries:
                continue  # a new hour: every slot is empty
            base = hour << 12
            if hour in self._checked_hours and len(seconds) < _WHOLE_TABLE_FROM:
                for second, value in self._tables.read_slots(hour, sorted(seconds)).items():
                    heads[base | second] = value
                continue
            table = self._tables.read(hour)
            if table is None or table.entries != summary.entries:
                found = "no whole table" if table is None else f"a table counting {table.entries}"
                raise CorruptSchedule(
                    f"hour {hour_name(hour)}: holds {summary.entries} entries but its heads have {found}; "
                    f"run rebuild_heads({hour})"
                )
            self._checked_hours.add(hour)
            newest, counts = table.newest, table.counts
            for second in seconds:
                count = counts[second]
                if count:
                    heads[base | second] = (newest[second] + 1) << 32 | count

    def commit(self, checkpoint: int) -> ReplayStep:
        """Write, fsync and commit what was staged, and save ``checkpoint`` with it.

        Each hour's log bytes and index bytes go out in one ``pwrite`` each. Few hours:
        each file is fdatasynced (with the heads tables the previous step wrote); many
        hours: one ``syncfs`` of the folder's file system costs less than thousands of
        fsyncs. Then one lmdb transaction holds the summaries, the checkpoint and the
        step's heads journal, and the journal's slots are written to the tables.
        """
        with self._write_lock:
            self._check_usable()
            if checkpoint < 0:
                raise ValueError(f"checkpoint must be >= 0, got {checkpoint}")
            written = [w for w in self._staged.values() if w.entries > w.committed_entries]
            summaries = {
                w.hour: HourSummary(w.entries, w.log_end, w.first_source, w.last_source) for w in written
            }
            previous = {hour: self._summaries.get(hour) for hour in summaries}
            try:
                self._write_out(written)
                # Entry counts move before the heads: an entry a reader can learn of (from
                # the heads or the arrivals) is always within ``entries``.
                self._summaries.update(summaries)
                with self._state.write() as batch:
                    for w in written:
                        batch.put(HOURS_DB, hour_key(w.hour), summaries[w.hour].pack())
                    batch.put(REPLAY_DB, CHECKPOINT_KEY, checkpoint.to_bytes(8, "big"))
                    batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(self._heads))
            except BaseException as error:
                for hour, summary in previous.items():
                    if summary is None:
                        self._summaries.pop(hour, None)
                    else:
                        self._summaries[hour] = summary
                self._abort()
                if isinstance(error, OSError):
                    # A failed fsync may have dropped dirty pages: trust nothing until reopen.
                    self._failure = error
                    raise ScheduleError(
                        f"replay commit at checkpoint {checkpoint} failed: {error}"
                    ) from error
                raise
            try:
                self._tables.write(self._heads)
            except BaseException as error:
                # Committed (nothing to cut back): the journal in lmdb is written into the
                # tables again when the store reopens.
                self._failure = error
                self._clear_step()
                if isinstance(error, OSError):
                    raise ScheduleError(
                        f"replay step committed at checkpoint {checkpoint}, but writing its heads "
                        f"tables failed: {error}; reopen the store to write them again"
                    ) from error
                raise
            arrivals: dict[int, HourArrivals] = {}
            new_hours = []
            nbytes = 0
            for w in written:
                if w.committed_entries == 0:
                    new_hours.append(w.hour)
                arrivals[w.hour] = HourArrivals(w.hour, w.committed_entries, w.ms)
                nbytes += w.log_end - w.committed_log_end
                self._checked_hours.add(w.hour)
            step = ReplayStep(
                start_offset=self._checkpoint,
                checkpoint=checkpoint,
                filed=self._step_filed,
                already_filed=self._step_already,
                skipped=self._step_skipped,
                bytes=max(0, checkpoint - self._checkpoint),
                arrivals=arrivals,
                new_hours=tuple(sorted(new_hours)),
            )
            self._checkpoint = checkpoint
            self._steps += 1
            self._filed += step.filed
            self._bytes_filed += nbytes
            self._clear_step()
            return step

    def _write_out(self, written: list[_Staging]) -> None:
        """Append each hour's staged bytes to its files (an empty heads table for a new
        hour) and make them durable, with the heads slots the previous step wrote."""
        prefix = str(self._folder.path) + os.sep
        tables = self._tables
        hours = tables.unsynced().union(w.hour for w in written)
        syncfs = self._fsync and len(hours) >= _SYNCFS_FROM_HOURS and _syncfs is not None
        per_file = self._fsync and not syncfs
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
                    _pwrite_all(fd, data, position, path)
                    if per_file:
                        os.fdatasync(fd)
                        self._fsyncs += 1
                finally:
                    os.close(fd)
        if syncfs:
            assert _syncfs is not None
            _syncfs(self._folder)
            self._syncfs += 1
            tables.synced()
        else:
            tables.sync()  # fdatasync each (nothing with fsync off)
            if per_file and created:
                self._folder.fsync()
                self._fsyncs += 1

    def abort(self) -> None:
        """Drop what was staged (nothing of it reaches lmdb; files are cut back)."""
        with self._write_lock:
            self._abort()

    def _abort(self) -> None:
        for w in self._staged.values():
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
                    self._failure = error
        self._clear_step()

    def _clear_step(self) -> None:
        self._staged = {}
        self._heads = {}
        self._step_filed = self._step_already = self._step_skipped = 0

    @property
    def staged_hours(self) -> int:
        """Hours the current (uncommitted) step has filed into."""
        return len(self._staged)

    # ------------------------------------------------------------------ reading

    def heads(self, hour: int) -> Heads:
        """The committed second-heads table of ``hour`` (all -1 / 0 for an hour without entries).

        ``heads.entries`` (the table as one step left it) is at most ``entries(hour)``."""
        if check_hour(hour) not in self._summaries:
            return Heads(hour, [-1] * SECONDS_PER_HOUR, [0] * SECONDS_PER_HOUR, 0)
        table = self._tables.read(hour)
        if table is None:
            raise CorruptSchedule(
                f"hour {hour_name(hour)}: its heads table {self._tables.path(hour)} is missing or cut short; "
                f"run rebuild_heads({hour})"
            )
        return table

    def newest_entry(self, hour: int, second: int) -> int:
        """The newest committed entry of ``second`` (0..3599) of ``hour``, -1 for none."""
        if hour not in self._summaries:
            return -1
        return self._tables.newest(hour, second)

    def open_hour(self, hour: int) -> HourLog:
        """A reader of one hour's index and schedule log; the caller closes it."""
        self._check_open()
        if hour not in self._summaries:
            raise ScheduleError(f"hour {hour_name(hour)} ({hour}) holds no entries")
        return HourLog(self, hour)

    def rebuild_heads(self, hour: int) -> Heads:
        """Recompute ``hour``'s heads table from its delay index and store it (replacing
        the stored one). For repair and checks; recovery does it when needed."""
        with self._write_lock:
            self._check_usable()
            if hour in self._staged:
                raise ScheduleError(f"hour {hour_name(hour)}: cannot rebuild heads during a replay step")
            summary = self._summaries.get(hour)
            if summary is None:
                return self.heads(hour)
            path = self.path_of(hour, INDEX_SUFFIX)
            data = path.read_bytes()[: summary.entries * ENTRY_SIZE]
            heads = heads_from_index(hour, data, where=str(path))
            if heads.entries != summary.entries:
                raise CorruptSchedule(
                    f"{path}: holds {heads.entries} entries, its summary says {summary.entries}"
                )
            slots = table_slots(hour, heads.newest, heads.counts)
            tables = self._tables
            tables.create(hour)
            tables.sync()  # the slots the last journal wrote, before it is replaced
            if self._fsync:
                self._folder.fsync()
            with self._state.write() as batch:
                batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(slots))
            tables.write(slots)
            self._checked_hours.add(hour)
            return heads

    # ------------------------------------------------------------------ dispatch logs

    def record_dispatched(self, hour: int, entry_nos: Iterable[int]) -> int:
        """Append entries a realtime server accepted to ``hour``'s dispatch log; returns how
        many were not recorded before. Written to the page cache: ``flush_dispatched``
        fsyncs (a lost tail only means a re-send)."""
        numbers = list(entry_nos)
        if not numbers:
            return 0
        entries = self.entries(hour)
        low, high = min(numbers), max(numbers)
        if low < 0 or high >= entries:
            bad = low if low < 0 else high
            raise ScheduleError(
                f"hour {hour_name(hour)}: entry_no {bad} is outside 0..{entries - 1} "
                f"(the hour holds {entries} entries)"
            )
        with self._dispatch_lock:
            log = self._dispatch_log(hour, create=True)
            assert log is not None
            return log.append(numbers)

    def flush_dispatched(self) -> None:
        """fsync every dispatch log appended to since the last flush."""
        with self._dispatch_lock:
            for log in self._dispatch.values():
                log.flush()

    def delivered(self, hour: int) -> set[int]:
        """The entry numbers of ``hour`` recorded as delivered."""
        with self._dispatch_lock:
            log = self._dispatch_log(hour, create=False)
            return set() if log is None else log.delivered()

    def dispatched_count(self, hour: int) -> int:
        """How many distinct entries of ``hour`` are recorded as delivered."""
        with self._dispatch_lock:
            log = self._dispatch_log(hour, create=False)
            return 0 if log is None else log.count

    def pending(self, hour: int) -> int:
        """Committed entries of ``hour`` not yet recorded as delivered."""
        return self.entries(hour) - self.dispatched_count(hour)

    def is_complete(self, hour: int) -> bool:
        """Every committed entry of ``hour`` is delivered (true for an hour without entries)."""
        return self.pending(hour) <= 0

    def undispatched_hours(self) -> list[int]:
        """Hours with entries not yet delivered, oldest first: what a restart loads."""
        return [hour for hour in self.hours_with_messages() if not self.is_complete(hour)]

    def _dispatch_log(self, hour: int, *, create: bool) -> DispatchLog | None:
        log = self._dispatch.get(hour)
        if log is not None:
            self._dispatch.move_to_end(hour)
            return log
        path = self.path_of(hour, DISPATCH_SUFFIX)
        exists = path.exists()
        if not exists and not create:
            return None
        log = DispatchLog.open(path)
        if not exists and self._fsync:
            self._folder.fsync()
        self._dispatch[hour] = log
        while len(self._dispatch) > self._max_open_dispatch_logs:
            _old, evicted = self._dispatch.popitem(last=False)
            evicted.close()
        return log

    # ------------------------------------------------------------------ cleanup

    def hours_to_delete(self, now_ms: int, *, retention_ms: int = DEFAULT_RETENTION_MS) -> list[int]:
        """Fully delivered hours that ended at least ``retention_ms`` before ``now_ms``."""
        if retention_ms < 0:
            raise ValueError(f"retention_ms must be >= 0, got {retention_ms}")
        last = (now_ms - retention_ms) // HOUR_MS  # hours ending by now - retention are < last
        return [hour for hour in self.hours_with_messages() if hour < last and self.is_complete(hour)]

    def delete_hour(self, hour: int, *, force: bool = False) -> None:
        """Delete ``hour``'s files (heads table included) and summary. Refuses an hour with undelivered
        entries unless ``force``. The dispatch log goes first, so a crash midway never
        leaves a dispatch log that could mark a re-created hour's entries delivered."""
        with self._write_lock, self._dispatch_lock:
            self._check_usable()
            if hour in self._staged:
                raise ScheduleError(f"hour {hour_name(hour)}: cannot delete during a replay step filing it")
            pending = self.pending(hour)
            if pending > 0 and not force:
                raise HourNotComplete(
                    f"hour {hour_name(hour)} still has {pending} of {self.entries(hour)} entries "
                    "undelivered; delete_hour(force=True) to drop them"
                )
            with self._state.write() as batch:
                batch.delete(HOURS_DB, hour_key(hour))
                summary = self._summaries.get(hour)
                if summary is not None:
                    last = summary.last_source.to_bytes(8, "big", signed=True)
                    batch.put(DELETED_DB, hour_key(hour), last)
            self._summaries.pop(hour, None)
            self._checked_hours.discard(hour)
            log = self._dispatch.pop(hour, None)
            if log is not None:
                log.close()
            for suffix in (DISPATCH_SUFFIX, INDEX_SUFFIX, LOG_SUFFIX):
                try:
                    self.path_of(hour, suffix).unlink()
                except FileNotFoundError:
                    pass
            self._tables.remove(hour)
            self._folder.fsync()
            _logger.info("schedule %s: deleted hour %s", self._folder.path, hour_name(hour))

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Drop an uncommitted step, close every file. The ``StateStore`` stays open (the caller's)."""
        with self._write_lock, self._dispatch_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._abort()
                for log in self._dispatch.values():
                    log.close()
                self._dispatch.clear()
            finally:
                self._folder.close()

    def __enter__(self) -> ScheduleStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hours = len(self._summaries)
        return f"<ScheduleStore {self._folder.path} hours={hours} checkpoint={self._checkpoint}>"

    def _check_open(self) -> None:
        if self._closed:
            raise ScheduleError(f"schedule store {self._folder.path} is closed")

    def _check_usable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise ScheduleError(
                f"schedule store {self._folder.path} refuses filing after an earlier failure "
                f"({self._failure}); reopen it to recover"
            )


# --------------------------------------------------------------------- reading one hour


class HourLog:
    """A reader of one hour: heads, chains, entries and records. Use ``ScheduleStore.open_hour``.

    Reads entries the store has committed (it learns their numbers from ``heads`` and
    replay arrivals). Safe to use from another thread than the one filing; one
    ``HourLog`` is used by one thread at a time. Close it before ``delete_hour``.
    """

    def __init__(self, store: ScheduleStore, hour: int) -> None:
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
            raise ScheduleError(
                f"second={second!r}: must be a second of the hour, 0..{SECONDS_PER_HOUR - 1}"
            )
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

    def read_records(self, entry_nos: Sequence[int]) -> list[bytes]:
        """The full message records of ``entry_nos``, in the order given, each CRC checked.

        Records close together in the schedule log are read with one ``pread``.
        """
        if not entry_nos:
            return []
        index = self._index_for(max(entry_nos))
        if min(entry_nos) < 0:
            self._index_for(min(entry_nos))  # raises, naming it
        unpack = ENTRY.unpack_from
        located = sorted((unpack(index, n * ENTRY_SIZE)[:2] + (i,) for i, n in enumerate(entry_nos)))
        out: list[bytes] = [b""] * len(entry_nos)
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
                if problem:
                    raise CorruptSchedule(
                        f"hour {self._name}: entry {entry_nos[i]}'s record at log byte {offset}: {problem}"
                    )
                out[i] = buf[position : position + length]
            k = j
        return out

    def _index_for(self, entry_no: int) -> mmap.mmap:
        """The index mapped far enough to hold ``entry_no`` (the file is only ever appended to)."""
        need = (entry_no + 1) * ENTRY_SIZE
        if need > self._mapped or entry_no < 0:
            size = os.fstat(self._index_fd).st_size
            if entry_no < 0 or size < need:
                raise ScheduleError(
                    f"hour {self._name}: entry_no {entry_no} is outside 0..{size // ENTRY_SIZE - 1}"
                )
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


# --------------------------------------------------------------------- file helpers


def _pwrite_all(fd: int, data: bytes | bytearray | memoryview, position: int, path: str) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        if written <= 0:
            raise OSError(28, f"write to {path} made no progress")
        view = view[written:]
        position += written


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


_syncfs = _find_syncfs()


__all__ = [
    "CHECKPOINT_KEY",
    "DISPATCH_SUFFIX",
    "HEADS_SUFFIX",
    "JOURNAL_KEY",
    "HOURS_DB",
    "INDEX_SUFFIX",
    "LOG_SUFFIX",
    "REPLAY_DB",
    "HourArrivals",
    "HourLog",
    "ReplayStep",
    "ScheduleStore",
    "ScheduleStoreStatistics",
]
