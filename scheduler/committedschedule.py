"""The committed side of a schedule store: what each hour holds and which entries are done.

``CommittedSchedule`` is what readers and the dispatcher use while replay files into
the same store from another thread: the committed summaries (entry counts), the heads
tables, ``open_hour`` (an ``HourLog``), and the dispatch-log calls that say which
committed entries are done, delivered (the hour's dispatch log, ``DispatchLogCache``)
or cancelled (lmdb ``scheduler.cancelled``, ``delaymq.scheduler.idindex``).
``ScheduleStore`` (``delaymq.scheduler.schedulelog``) is one, with filing, opening,
repair and cleanup; it moves the summaries and the cancelled counts as it commits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from delaymq.scheduler.delayindex import Heads, HourSummary
from delaymq.scheduler.dispatchlog import DispatchLogCache
from delaymq.scheduler.headstable import HeadsTables
from delaymq.scheduler.hourlog import HourLog
from delaymq.scheduler.hours import (
    DEFAULT_RETENTION_MS,
    HOUR_MS,
    SECONDS_PER_HOUR,
    CorruptSchedule,
    ScheduleError,
    check_hour,
    hour_name,
)
from delaymq.scheduler.idindex import cancelled_counts, cancelled_entries
from delaymq.storage.folder import DataFolder
from delaymq.storage.state import StateStore


class CommittedSchedule:
    """The committed hours of a schedule folder and their dispatch logs (see the module).

    Thread use: safe from other threads than the one filing; dispatch-log calls take the
    dispatch-log cache's lock.
    """

    def __init__(
        self,
        folder: DataFolder,
        state: StateStore,
        summaries: dict[int, HourSummary],
        *,
        tables: HeadsTables,
        dispatch_hours: set[int],
        max_open_dispatch_logs: int,
        fsync: bool,
    ) -> None:
        self._folder = folder
        self._state = state
        self._summaries = summaries
        self._tables = tables
        #: The hours that have a dispatch log (found at open, or appended to since): the
        #: others have delivered nothing, which ``pending`` then knows without a ``stat``
        #: (a restart asks it of every hour of the backlog).
        self._dispatch_hours = dispatch_hours
        self._dispatch = DispatchLogCache(folder, max_open=max_open_dispatch_logs, fsync=fsync, hours=dispatch_hours)
        #: Entries per hour that filed CANCEL and MOVE records took out (lmdb
        #: ``scheduler.cancelled``): done, as delivered ones are. Read once here.
        self._cancelled = cancelled_counts(state)
        self._closed = False
        #: The message log's ``read_recent_many``, set by its owner: ``HourLog.read_records``
        #: takes a record from there when the bytes it was filed from are still in memory.
        self.recent_source: Callable[[list[tuple[int, int]]], list[bytes | None]] | None = None

    @property
    def directory(self) -> Path:
        return self._folder.path

    @property
    def state(self) -> StateStore:
        return self._state

    def hours_with_messages(self) -> list[int]:
        """The hours holding at least one committed entry, oldest first."""
        return sorted(self._summaries)

    def entries(self, hour: int) -> int:
        """How many committed entries ``hour`` holds (0 for an hour without files)."""
        summary = self._summaries.get(hour)
        return summary.entries if summary is not None else 0

    def path_of(self, hour: int, suffix: str) -> Path:
        """The file of ``hour`` with ``suffix`` (``LOG_SUFFIX``, ``INDEX_SUFFIX``, ``DISPATCH_SUFFIX``,
        ``HEADS_SUFFIX``)."""
        return self._folder.path / (hour_name(hour) + suffix)

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

    def read_record(self, hour: int, entry_no: int) -> bytes:
        """One filed record (a MOVE re-files it with a new ``deliver_at``)."""
        with self.open_hour(hour) as reader:
            return reader.read_records([entry_no])[0]

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
                f"hour {hour_name(hour)}: entry_no {bad} is outside 0..{entries - 1} (the hour holds {entries} entries)"
            )
        self._dispatch_hours.add(hour)  # before the file is created: never a log it does not know of
        return self._dispatch.append(hour, numbers)

    def flush_dispatched(self) -> None:
        """fsync every dispatch log appended to since the last flush."""
        self._dispatch.flush()

    def delivered(self, hour: int) -> set[int]:
        """The entry numbers of ``hour`` that are done: recorded as delivered, or cancelled
        (what the wheel skips)."""
        done = self._dispatch.delivered(hour) if hour in self._dispatch_hours else set()
        if self._cancelled.get(hour):
            done.update(cancelled_entries(self._state, hour))
        return done

    def cancelled(self, hour: int) -> list[int]:
        """The entry numbers of ``hour`` that filed CANCEL and MOVE records took out."""
        return cancelled_entries(self._state, hour) if self._cancelled.get(hour) else []

    def delivered_among(self, hour: int, entry_nos: list[int]) -> list[bool]:
        """Whether each entry of ``hour`` is in its dispatch log (delivered; a cancelled entry
        is known as such from its id's value, ``delaymq.scheduler.idindex``)."""
        if hour not in self._dispatch_hours:
            return [False] * len(entry_nos)
        with self._dispatch.lock:
            log = self._dispatch._open(hour, create=False)  # the cached log: a bitmap test each
            if log is None:
                return [False] * len(entry_nos)
            return [entry in log for entry in entry_nos]

    def dispatched_count(self, hour: int) -> int:
        """How many distinct entries of ``hour`` are done: recorded as delivered, or cancelled."""
        logged = self._dispatch.count(hour) if hour in self._dispatch_hours else 0
        if not self._cancelled.get(hour):
            return logged
        cancelled = cancelled_entries(self._state, hour)
        if logged:
            among = self.delivered_among(hour, cancelled)
            return logged + among.count(False)
        return len(cancelled)

    def pending(self, hour: int) -> int:
        """Committed entries of ``hour`` not yet recorded as delivered."""
        return self.entries(hour) - self.dispatched_count(hour)

    def is_complete(self, hour: int) -> bool:
        """Every committed entry of ``hour`` is delivered (true for an hour without entries)."""
        return self.pending(hour) <= 0

    def undispatched_hours(self) -> list[int]:
        """Hours with entries not yet delivered, oldest first: what a restart loads."""
        return [hour for hour in self.hours_with_messages() if not self.is_complete(hour)]

    def hours_to_delete(self, now_ms: int, *, retention_ms: int = DEFAULT_RETENTION_MS) -> list[int]:
        """Fully delivered hours that ended at least ``retention_ms`` before ``now_ms``."""
        if retention_ms < 0:
            raise ValueError(f"retention_ms must be >= 0, got {retention_ms}")
        last = (now_ms - retention_ms) // HOUR_MS  # hours ending by now - retention are < last
        return [hour for hour in self.hours_with_messages() if hour < last and self.is_complete(hour)]

    def _check_open(self) -> None:
        if self._closed:
            raise ScheduleError(f"schedule store {self._folder.path} is closed")


__all__ = ["CommittedSchedule"]
