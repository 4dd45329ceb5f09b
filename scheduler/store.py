"""A scheduler's data folder, open: ``SchedulerStorage``.

``messages/`` is the write-ahead message log, ``state/`` the lmdb state, ``schedule/``
the hourly schedule logs (docs/scheduler-storage.md). A cut-back (async replication's
divergence: ``cut_back``) closes the schedule store and opens it again, so whoever
needs the store asks ``storage.schedule`` for the one open now.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from delaymq.scheduler.counters import COUNTERS_DB, COUNTERS_KEY, SchedulerCounters
from delaymq.scheduler.cutback import cut_schedule_folder, lower_checkpoint
from delaymq.scheduler.idcutback import drop_from
from delaymq.scheduler.replay import REPLAY_RECENT_BYTES
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.format import read_format, write_format
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CutBack:
    """What one cut-back removed: log records and bytes, and filed entries (async replication)."""

    records: int
    size: int
    entries: int


class SchedulerStorage:
    """The message log, the lmdb state and the schedule store of one data folder.

    Open it with ``SchedulerStorage.open`` and close it with ``close`` (both blocking).
    ``schedule`` is the schedule store open now: ``cut_back`` replaces it.
    """

    def __init__(self, root: Path, message_log: SegmentedLog, state: StateStore, schedule: ScheduleStore) -> None:
        self.root = root
        self.message_log = message_log
        self.state = state
        self.schedule = schedule
        #: Records filed by schedule stores a cut-back closed (a reopened store counts from 0).
        self.filed_by_closed_stores = 0
        self.cut_records = 0
        self.cut_bytes = 0

    @classmethod
    def open(cls, root: Path, *, segment_size: int) -> SchedulerStorage:
        """Open (or create) the data folder at ``root``. Blocking."""
        root.mkdir(parents=True, exist_ok=True)
        _adopt_segment_size(root / "messages", segment_size)
        message_log = SegmentedLog.open(root / "messages", segment_size=segment_size)
        try:
            message_log.keep_recent(REPLAY_RECENT_BYTES)  # replay files what was just appended from memory
            state = StateStore.open(root / "state", extra_format={"scheduler_state": 1})
            try:
                schedule = _open_schedule(root / "schedule", state, message_log)
            except BaseException:
                state.close()
                raise
        except BaseException:
            message_log.close()
            raise
        return cls(root, message_log, state, schedule)

    def close(self) -> None:
        """Close the schedule store, the message log and the state, in turn. Blocking."""
        try:
            self.schedule.close()
        finally:
            try:
                self.message_log.close()
            finally:
                self.state.close()

    def counters(self) -> SchedulerCounters:
        """This process's share of the totals: records filed by every schedule store it opened, and cut back."""
        return SchedulerCounters(
            filed=self.filed_by_closed_stores + self.schedule.statistics().filed,
            cut_records=self.cut_records,
            cut_bytes=self.cut_bytes,
        )

    def load_counters(self, group: str) -> SchedulerCounters:
        """The counters saved in the lmdb state (zeros for a new folder, or one whose record is unreadable). Blocking."""
        data = self.state.get(COUNTERS_DB, COUNTERS_KEY)
        if data is None:
            return SchedulerCounters()
        try:
            return SchedulerCounters.unpack(data)
        except ValueError as error:
            log.warning("scheduler %s: saved counters unreadable (%s): counting again from zero", group, error)
            return SchedulerCounters()

    def save_counters(self, counters: SchedulerCounters) -> None:
        """Save the counters in the lmdb state (one small transaction). Blocking."""
        self.state.put(COUNTERS_DB, COUNTERS_KEY, counters.pack())

    def cut_back(self, offset: int, *, filed: bool) -> CutBack:
        """Cut the message log back to ``offset``, a tail the master never had. ``filed``: replay
        filed part of it already (async replication), so the filed entries are cut too and
        the schedule store is opened again (``schedule`` is then another object). Blocking."""
        records = sum(1 for _ in self.message_log.iter_from(offset))
        entries = 0
        if filed:
            folder = self.schedule.directory
            self.filed_by_closed_stores += self.schedule.statistics().filed
            self.schedule.close()
            entries = cut_schedule_folder(folder, offset)
            size = self.message_log.truncate(offset)
            # Ids whose last record was cut (their entries may be reused) and cancels that were cut:
            # before the store opens, which counts the cancelled entries.
            drop_from(self.state, offset, folder)
            lower_checkpoint(self.state, offset)
            self.schedule = _open_schedule(folder, self.state, self.message_log)
        else:
            size = self.message_log.truncate(offset)
        self.cut_records += records
        self.cut_bytes += size
        return CutBack(records, size, entries)


def _open_schedule(folder: Path, state: StateStore, message_log: SegmentedLog) -> ScheduleStore:
    store = ScheduleStore.open(folder, state)
    store.recent_source = message_log.read_recent_many  # what is due soon is loaded from memory
    return store


def _adopt_segment_size(messages: Path, segment_size: int) -> None:
    """Let a message log written with another segment size take ``segment_size``.

    The size only says when an append starts a new segment: reading, recovery and
    replication never use it (segments are found by name, records never span two), so
    an existing folder (1 GiB segments, the size before 64 MiB) opens with the new size
    and its present segments stay as they are until filed and deleted. Every other
    format parameter is still checked by ``SegmentedLog.open``.
    """
    stored = read_format(messages)
    if stored is None or stored.get("segment_size") == segment_size or type(stored.get("segment_size")) is not int:
        return
    log.info(
        "message log %s: segments were %s bytes, new ones will be %d (existing segments stay as they are)",
        messages,
        stored["segment_size"],
        segment_size,
    )
    write_format(messages, {**stored, "segment_size": segment_size})


__all__ = ["CutBack", "SchedulerStorage"]
