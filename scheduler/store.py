"""A scheduler's data folder, open: ``SchedulerStorage``.

``messages/`` is the write-ahead message log, ``state/`` the lmdb state, ``schedule/``
the hourly schedule logs (docs/scheduler-storage.md). A cut-back (async replication's
divergence: ``cut_back``) closes the schedule store and opens it again, so whoever
needs the store asks ``storage.schedule`` for the one open now.

Damage found on open costs no filed message. A message log that ends below the replay
checkpoint lost records that were filed (the schedule logs hold them): it goes on at the
checkpoint, empty (``restart_at``), so no new record takes an offset a lost one had,
which filing would skip as filed; a slave asking for an offset below it is told the
master's log starts there. When recovery moves the checkpoint back to re-file entries an
hour lost, it is moved on back to the start of its segment: a record of the log starts
there (the moved point may lie inside a MOVE or LATE record, whose records would file
as records of their own); replay skips again what is filed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from delaymq.scheduler.counters import COUNTERS_DB, COUNTERS_KEY, SchedulerCounters
from delaymq.scheduler.cutback import cut_schedule_folder, lower_checkpoint
from delaymq.scheduler.delayindex import CHECKPOINT_KEY, REPLAY_DB
from delaymq.scheduler.idcutback import drop_from
from delaymq.scheduler.replay import REPLAY_RECENT_BYTES
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.storage.format import read_format, write_format
from delaymq.storage.log import SegmentedLog
from delaymq.storage.recovery import restart_at
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
        #: Message-log bytes found lost below the checkpoint on open: filed, so no message lost.
        self.lost_log_bytes = 0

    @classmethod
    def open(cls, root: Path, *, segment_size: int) -> SchedulerStorage:
        """Open (or create) the data folder at ``root``. Blocking."""
        root.mkdir(parents=True, exist_ok=True)
        _adopt_segment_size(root / "messages", segment_size)
        message_log = _open_message_log(root / "messages", segment_size)
        try:
            state = StateStore.open(root / "state", extra_format={"scheduler_state": 1})
            try:
                schedule = _open_schedule(root / "schedule", state, message_log)
            except BaseException:
                state.close()
                raise
        except BaseException:
            message_log.close()
            raise
        storage = cls(root, message_log, state, schedule)
        if schedule.checkpoint > message_log.end_offset:
            try:
                storage._go_on_past_lost_records(segment_size)
            except BaseException:
                storage.close()
                raise
        return storage

    def _go_on_past_lost_records(self, segment_size: int) -> None:
        """The message log ends below the checkpoint: it lost records replay had filed (their
        messages are in the schedule logs). It goes on, empty, at the checkpoint (``restart_at``),
        so no new record takes the offset of a lost one. Logged and counted. Blocking."""
        checkpoint, end = self.schedule.checkpoint, self.message_log.end_offset
        directory = self.message_log.directory
        self.message_log.close()
        held = restart_at(directory, checkpoint)
        self.message_log = _open_message_log(directory, segment_size)
        self.schedule.recent_source = self.message_log.read_recent_many
        self.lost_log_bytes += checkpoint - end
        log.warning(
            "scheduler message log %s ends at offset %d, below the %d it had filed: the %d byte(s) between "
            "held filed records (their messages are in the schedule logs and are delivered); the log "
            "goes on at offset %d without its %d filed byte(s) before (a slave behind that offset must be "
            "given a copy of this data folder)",
            directory, end, checkpoint, checkpoint - end, checkpoint, held,
        )  # fmt: skip

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
            lost_log_bytes=self.lost_log_bytes,
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


def _open_message_log(directory: Path, segment_size: int) -> SegmentedLog:
    message_log = SegmentedLog.open(directory, segment_size=segment_size)
    message_log.keep_recent(REPLAY_RECENT_BYTES)  # replay files what was just appended from memory
    return message_log


def _open_schedule(folder: Path, state: StateStore, message_log: SegmentedLog) -> ScheduleStore:
    """Open the schedule store (recovery runs); a checkpoint recovery moved back goes on back to
    the start of its message-log segment, where a record starts."""
    stored = state.get(REPLAY_DB, CHECKPOINT_KEY)
    store = ScheduleStore.open(folder, state)
    checkpoint = store.checkpoint
    if stored is not None and checkpoint < int.from_bytes(stored, "big"):
        start = _segment_start(message_log, checkpoint)
        if start < checkpoint:
            store.close()
            lower_checkpoint(state, start)
            store = ScheduleStore.open(folder, state)
    store.recent_source = message_log.read_recent_many  # what is due soon is loaded from memory
    return store


def _segment_start(message_log: SegmentedLog, offset: int) -> int:
    """The start of the segment holding ``offset`` (a record starts there); ``offset`` itself
    if no segment holds it (deleted: replay says so; at or past the end: nothing to read)."""
    if offset < message_log.start_offset or offset >= message_log.end_offset:
        return offset
    return max(base for base, _size in message_log.segments() if base <= offset)


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
