"""The schedule store: hourly schedule logs, their delay indexes and heads, dispatch logs.

One folder (``schedule/``) holds, per UTC hour that has messages, four files named by
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

``ScheduleStore`` is the one entry point; its parts, one module each:

- filing, ``stage`` (driven by ``delaymq.scheduler.replay``): ``staging.StagedStep``
  stages records per hour in memory (index entries packed into a bytearray, record
  bytes as slices of the chunk read from the message log);
- ``commit`` (here): ``schedulefiles.ScheduleFiles`` writes each hour's log bytes and
  index bytes with one ``pwrite`` each and makes them durable (fdatasync per file, or
  one ``syncfs`` when a step touched many hours) together with the heads slots the
  previous step wrote; then lmdb commits and the step's heads slots are written;
- ``open``: ``schedulefolder.open_schedule_folder`` checks the ``FORMAT`` and runs
  ``recovery.recover_hours``. A crash before the lmdb commit leaves entries
  beyond the committed summary: recovery checks them and keeps the valid prefix; an
  hour whose files end where its summary says is not read at all.
  Replay skips a record whose message-log offset is not after its hour's last filed
  one, so re-reading from the checkpoint files nothing twice;
- reading, ``open_hour``: ``hourlog.HourLog``, used by the dispatcher from another
  thread while replay files; it sees committed entries only. It, ``record_dispatched``
  and the other dispatch-log calls (``dispatchlog.DispatchLogCache``) are those of
  ``committedschedule.CommittedSchedule``, the store's committed side.

What the folder holds on disk (``log_bytes``) is counted, never walked: an hour's
schedule log, index and heads table hold exactly what its committed summary says once
recovery has run (``summary_bytes``), so the count moves with each commit and deletion;
the dispatch logs' count is the cache's. Each fsync of filing and of dispatch-log
flushes is timed (``fsync_durations_us``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from delaymq.scheduler.committedschedule import CommittedSchedule
from delaymq.scheduler.delayindex import (
    CHECKPOINT_KEY,
    DELETED_DB,
    HOURS_DB,
    JOURNAL_KEY,
    REPLAY_DB,
    Heads,
    HourSummary,
    hour_key,
    pack_journal,
)
from delaymq.scheduler.headstable import HeadsTables
from delaymq.scheduler.hours import (
    DISPATCH_SUFFIX,
    HEADS_SUFFIX,
    INDEX_SUFFIX,
    LOG_SUFFIX,
    HourNotComplete,
    ScheduleError,
    hour_name,
)
from delaymq.scheduler.idindex import CANCELLED_DB, IDS_DB, cancelled_key, forget_hour
from delaymq.scheduler.recovery import RecoveredHours
from delaymq.scheduler.schedulefiles import ScheduleFiles
from delaymq.scheduler.schedulefolder import (
    STORE_FORMAT,
    STORE_FORMAT_VERSION,
    open_schedule_folder,
    rebuild_heads_table,
    summary_bytes,
)
from delaymq.scheduler.staging import ReplayStep, StagedHour, StagedStep
from delaymq.storage.folder import DataFolder
from delaymq.storage.state import StateStore

#: Hours one replay step may file into: every hour of a two-year horizon and then some.
DEFAULT_MAX_STEP_HOURS = 20_000
DEFAULT_MAX_OPEN_DISPATCH_LOGS = 256

_logger = logging.getLogger(__name__)


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
    checked_hours: int  # hours whose files open read and checked; the others matched their committed summary
    redone_slots: int  # heads slots open wrote again from the last journal (0 when the tables held it)


class ScheduleStore(CommittedSchedule):
    """The schedule folder of one scheduler. Use ``ScheduleStore.open``.

    Thread use: one thread at a time files (``stage``/``commit``, or ``replay_step``);
    readers (``open_hour``, ``heads``), dispatch-log calls and cleanup may run in
    other threads meanwhile. Reading and the dispatch-log calls are ``CommittedSchedule``'s
    (``delaymq.scheduler.committedschedule``).
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
        recovered: RecoveredHours,
    ) -> None:
        super().__init__(
            folder,
            state,
            summaries,
            tables=tables,
            dispatch_hours=recovered.dispatch_hours,
            max_open_dispatch_logs=max_open_dispatch_logs,
            fsync=fsync,
        )
        self._checkpoint = checkpoint
        self._fsync = fsync
        # Hours whose table was checked against their summary since open (one int per
        # hour with messages, like ``_summaries``).
        self._checked_hours: set[int] = set()
        self._step = StagedStep(
            summaries, self._checked_hours, tables, state, max_step_hours=max_step_hours, folder=folder.path
        )
        self._files = ScheduleFiles(folder, tables, fsync=fsync)
        self._write_lock = threading.RLock()
        #: Bytes of the hours' schedule logs, indexes and heads tables (``summary_bytes``),
        #: moved under the write lock by each commit and deletion.
        self._schedule_bytes = sum(map(summary_bytes, summaries.values()))
        self._failure: BaseException | None = None
        self._steps = self._filed = self._bytes_filed = 0
        self._recovered = recovered

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
            tables, recovered = open_schedule_folder(folder, state, fsync=fsync)
        except BaseException:
            folder.close()
            raise
        return cls(
            folder,
            state,
            recovered.summaries,
            recovered.checkpoint,
            tables=tables,
            max_step_hours=max_step_hours,
            max_open_dispatch_logs=max_open_dispatch_logs,
            fsync=fsync,
            recovered=recovered,
        )

    # ------------------------------------------------------------------ properties

    @property
    def checkpoint(self) -> int:
        """The message-log offset replay resumes from: every record below it is filed
        (and fsynced), so ``message_log.delete_before(checkpoint)`` is safe."""
        return self._checkpoint

    def past_every_indexed(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` sorts after every key the id index holds, so none is
        in it: known from memory, no read. New time-ordered ids (``new_message_id``) do."""
        return bool(keys) and min(keys).encode() > self._state.highest_key(IDS_DB)

    def statistics(self) -> ScheduleStoreStatistics:
        summaries = list(self._summaries.values())
        return ScheduleStoreStatistics(
            hours=len(summaries),
            entries=sum(s.entries for s in summaries),
            checkpoint=self._checkpoint,
            steps=self._steps,
            filed=self._filed,
            bytes_filed=self._bytes_filed,
            fsyncs=self._files.fsyncs + self._tables.fsyncs,
            syncfs=self._files.syncfs_calls + self._tables.syncfs_calls,
            heads_held=len(self._step.heads),
            heads_held_max=self._step.heads_max,
            recovered_hours=self._recovered.repaired,
            checked_hours=self._recovered.checked,
            redone_slots=self._recovered.redone_slots,
        )

    def log_bytes(self) -> dict[str, int]:
        """Bytes on disk: ``"schedule"`` (every hour's schedule log, delay index and heads
        table), ``"dispatch"`` (the dispatch logs). Kept as counts: no ``stat`` per call."""
        return {"schedule": self._schedule_bytes, "dispatch": self._dispatch.bytes}

    def fsync_durations_us(self) -> dict[str, dict[str, Any]]:
        """How long fsyncs took, µs (``LatencyHistogram.to_wire``): ``"schedule"``, each of
        filing's (``fsyncs`` + ``syncfs`` of ``statistics``), and ``"dispatch"``, each of a
        dispatch-log flush."""
        return {
            "schedule": self._tables.fsync_durations.to_wire(),
            "dispatch": self._dispatch.fsync_durations.to_wire(),
        }

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
                return self._step.stage(buf, source, len(buf) if stop is None else stop)
            except BaseException:
                self._abort()
                raise

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
            written = [w for w in self._step.hours.values() if w.entries > w.committed_entries]
            summaries = {w.hour: HourSummary(w.entries, w.log_end, w.first_source, w.last_source) for w in written}
            previous = {hour: self._summaries.get(hour) for hour in summaries}
            self._write_and_commit(written, summaries, previous, checkpoint)
            self._write_step_heads(checkpoint)
            return self._count_step(written, summaries, previous, checkpoint)

    def _write_and_commit(
        self,
        written: list[StagedHour],
        summaries: dict[int, HourSummary],
        previous: dict[int, HourSummary | None],
        checkpoint: int,
    ) -> None:
        """Write the step's files durably, then commit its summaries, checkpoint, heads journal
        and index changes in one lmdb transaction. On failure the step is aborted and the
        summaries put back."""
        changes = self._step.changes
        try:
            # The step's cancels go to lmdb with its checkpoint: until that commit, a restart
            # replays the CANCEL and MOVE records again before any wheel runs.
            self._files.append(written)
            # Entry counts move before the heads: an entry a reader can learn of (from
            # the heads or the arrivals) is always within ``entries``.
            self._summaries.update(summaries)
            with self._state.write() as batch:
                for w in written:
                    batch.put(HOURS_DB, hour_key(w.hour), summaries[w.hour].pack())
                batch.put(REPLAY_DB, CHECKPOINT_KEY, checkpoint.to_bytes(8, "big"))
                batch.put(REPLAY_DB, JOURNAL_KEY, pack_journal(self._step.heads))
                changes.write(batch)
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
                raise ScheduleError(f"replay commit at checkpoint {checkpoint} failed: {error}") from error
            raise

    def _write_step_heads(self, checkpoint: int) -> None:
        """Write the committed step's heads journal into the tables."""
        try:
            self._tables.write(self._step.heads)
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

    def _count_step(
        self,
        written: list[StagedHour],
        summaries: dict[int, HourSummary],
        previous: dict[int, HourSummary | None],
        checkpoint: int,
    ) -> ReplayStep:
        """Move the counts by the committed step, clear it, and say what it did."""
        for hour, entries in self._step.changes.cancelled.items():
            self._cancelled[hour] = self._cancelled.get(hour, 0) + len(entries)
        step = self._step.outcome(written, self._checkpoint, checkpoint)
        nbytes = 0
        grown = 0
        for w in written:
            nbytes += w.log_end - w.committed_log_end
            self._checked_hours.add(w.hour)
            before = previous[w.hour]
            grown += summary_bytes(summaries[w.hour]) - (summary_bytes(before) if before is not None else 0)
        self._schedule_bytes += grown
        self._checkpoint = checkpoint
        self._steps += 1
        self._filed += step.filed
        self._bytes_filed += nbytes
        self._clear_step()
        return step

    def abort(self) -> None:
        """Drop what was staged (nothing of it reaches lmdb; files are cut back)."""
        with self._write_lock:
            self._abort()

    def _abort(self) -> None:
        failure = self._files.cut_back(self._step.hours.values())
        if failure is not None:
            self._failure = failure
        self._clear_step()

    def _clear_step(self) -> None:
        self._step.clear()

    @property
    def staged_hours(self) -> int:
        """Hours the current (uncommitted) step has filed into."""
        return len(self._step.hours)

    # ------------------------------------------------------------------ repair

    def rebuild_heads(self, hour: int) -> Heads:
        """Recompute ``hour``'s heads table from its delay index and store it (replacing
        the stored one). For repair and checks; recovery does it when needed."""
        with self._write_lock:
            self._check_usable()
            if hour in self._step.hours:
                raise ScheduleError(f"hour {hour_name(hour)}: cannot rebuild heads during a replay step")
            summary = self._summaries.get(hour)
            if summary is None:
                return self.heads(hour)
            heads = rebuild_heads_table(self._folder, self._state, self._tables, hour, summary, fsync=self._fsync)
            self._checked_hours.add(hour)
            return heads

    # ------------------------------------------------------------------ cleanup

    def delete_hour(self, hour: int, *, force: bool = False) -> None:
        """Delete ``hour``'s files (heads table included) and summary. Refuses an hour with undelivered
        entries unless ``force``. The dispatch log goes first, so a crash midway never
        leaves a dispatch log that could mark a re-created hour's entries delivered."""
        with self._write_lock, self._dispatch.lock:
            self._check_usable()
            if hour in self._step.hours:
                raise ScheduleError(f"hour {hour_name(hour)}: cannot delete during a replay step filing it")
            pending = self.pending(hour)
            if pending > 0 and not force:
                raise HourNotComplete(
                    f"hour {hour_name(hour)} still has {pending} of {self.entries(hour)} entries "
                    "undelivered; delete_hour(force=True) to drop them"
                )
            # The id index first: a crash midway leaves the hour, deleted again next time.
            forget_hour(self._state, hour, str(self.path_of(hour, LOG_SUFFIX)), self.entries(hour))
            cancelled = self.cancelled(hour)
            with self._state.write() as batch:
                batch.delete(HOURS_DB, hour_key(hour))
                for entry in cancelled:
                    batch.delete(CANCELLED_DB, cancelled_key(hour, entry))
                summary = self._summaries.get(hour)
                if summary is not None:
                    last = summary.last_source.to_bytes(8, "big", signed=True)
                    batch.put(DELETED_DB, hour_key(hour), last)
            self._summaries.pop(hour, None)
            if summary is not None:
                self._schedule_bytes -= summary_bytes(summary)
            self._cancelled.pop(hour, None)
            self._checked_hours.discard(hour)
            self._dispatch.forget(hour)
            self._dispatch_hours.discard(hour)
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
        with self._write_lock, self._dispatch.lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._abort()
                self._dispatch.close()
            finally:
                self._folder.close()

    def __enter__(self) -> ScheduleStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        hours = len(self._summaries)
        return f"<ScheduleStore {self._folder.path} hours={hours} checkpoint={self._checkpoint}>"

    def _check_usable(self) -> None:
        self._check_open()
        if self._failure is not None:
            raise ScheduleError(
                f"schedule store {self._folder.path} refuses filing after an earlier failure "
                f"({self._failure}); reopen it to recover"
            )


__all__ = [
    "CHECKPOINT_KEY",
    "DISPATCH_SUFFIX",
    "HEADS_SUFFIX",
    "JOURNAL_KEY",
    "HOURS_DB",
    "INDEX_SUFFIX",
    "LOG_SUFFIX",
    "REPLAY_DB",
    "STORE_FORMAT",
    "STORE_FORMAT_VERSION",
    "ScheduleStore",
    "ScheduleStoreStatistics",
]
