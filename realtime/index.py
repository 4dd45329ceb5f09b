"""The index step: message-log records become consume-log entries, in offset order.

A SEND hands over what it appended (``submit``) right after the append is
durable; batches of one write group may arrive out of order, so they wait in
``_waiting`` until every byte before them is indexed. ``indexed_offset`` is thus
always a clean cut: every record below it is in its consume log. A checkpoint
stores that offset (with each subject's entry count, fsynced first); after a
crash ``replay`` reads the message log from it with the very same indexing
step, and the consume logs confirm or rewrite the entries past their
checkpoint, so nothing acknowledged is ever missing from a consume log.

A batch is indexed whole or not at all: if a consume-log write fails (a full
disk), every entry of it is taken back and the index **stalls** at that batch.
``submit`` still answers at once (the records are durable in the message log,
so they will be delivered); the batches behind it wait, and ``run`` retries the
step with backoff, logging once when it stalls and once when it goes on, until
it succeeds and the waiting batches follow.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import trio

from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.protocol.backoff import Backoff, BackoffRun
from delaymq.protocol.envelope import HEADER_SIZE, iter_spans
from delaymq.protocol.records import MessageBatch, scan_batch, tags_mask
from delaymq.realtime.consumelog import HELD, OPEN_CONSUME_LOGS, ConsumeLog, list_subjects, subject_stem
from delaymq.realtime.dedup import dedup_keys
from delaymq.realtime.openfiles import OpenFiles
from delaymq.realtime.progress import MESSAGE_KIND, PROGRESS_KIND, kind_runs
from delaymq.storage.errors import CorruptLog, describe
from delaymq.storage.log import SegmentedLog

log = logging.getLogger(__name__)

#: Waits between retries of a stalled index step: soon at first, at most a second
#: apart, so delivery resumes within about a second of space coming back.
RETRY_BACKOFF = Backoff(initial_ms=10, maximum_ms=1000, jitter="equal")

#: Every record the message log may hold passes these (replay must not refuse
#: old records because this run was started with smaller limits).
REPLAY_LIMITS = Limits(
    max_frame=0xFFFF_FFFF,
    max_body=0xFFFF_FFFF,
    max_subject=0xFFFF,
    max_id=0xFFFF,
    max_tags=0xFF,
    max_tag=0xFF,
    max_properties=0xFFFF_FFFF,
)

#: Consume logs that keep entries in memory at most (``ConsumeLog.TAIL_ENTRIES`` of 32 bytes
#: each in its tail and as many in a window: 128 KiB a log, 8 MiB in all).
HELD_LOGS = 64

#: A record sent ahead of its ``deliver_at`` (a scheduled one: ``deliver_at`` after its
#: ``created_at``, the rule ``send._check_ahead`` and the scheduler's lanes use too) is
#: handed out from the next multiple of this (epoch ms) at or after it: while messages fall
#: due every millisecond, a consumer's pulls then come at most this often, each with what
#: fell due meanwhile (a PULL costs the server about as much as its messages), for at most
#: this much lateness. Records stored at or after their ``deliver_at``, and immediate ones
#: whatever their ``deliver_at`` (a producer's clock), are handed out at once.
RELEASE_TICK_MS = 4
#: How far ahead of now a scheduled record may come (SEND refuses one due later): a realtime
#: server holds records back until due only for a scheduler sending ahead (seconds at most),
#: not as a delay queue. Indexing holds nothing longer than this either (a record an older
#: server took further ahead, replayed or copied by a slave, is handed out at once).
MAX_AHEAD_MS = 60_000

#: One indexed record: (subject, message-log offset, size, tag mask, release_at): release_at is
#: a scheduled record's ``deliver_at``, 0 for an immediate one (handed out at once).
Item = tuple[str, int, int, int, int]


def batch_items(batch: MessageBatch, base: int, kept: Iterable[int]) -> list[Item]:
    """The items of ``batch``'s records ``kept`` (ascending), appended back to back from offset ``base``."""
    items: list[Item] = []
    offset = base
    starts, ends, subjects, tags = batch.starts, batch.ends, batch.subjects, batch.tags
    deliver_ats, created_ats = batch.deliver_ats, batch.created_ats
    for i in kept:
        size = ends[i] - starts[i]
        record_tags = tags[i]
        due = deliver_ats[i]
        release_at = due if due > created_ats[i] else 0
        items.append((subjects[i], offset, size, tags_mask(record_tags) if record_tags else 0, release_at))
        offset += size
    return items


class Indexer:
    """Owns the consume logs and keeps them up with the message log."""

    def __init__(
        self,
        directory: Path,
        *,
        indexed_offset: int,
        on_indexed: Callable[[set[str]], None] | None = None,
        on_ids: Callable[[list[str], int, int], None] | None = None,
        open_files: int = OPEN_CONSUME_LOGS,
    ) -> None:
        self.directory = directory
        #: The consume logs holding a descriptor: at most ``open_files`` (``delaymq.realtime.openfiles``).
        self.files = OpenFiles(open_files)
        self.indexed_offset = indexed_offset
        self.logs: dict[str, ConsumeLog] = {}
        self._checkpoint_counts: dict[str, int] = {}
        self._waiting: dict[int, tuple[int, list[Item], list[str], int]] = {}
        self.on_indexed = on_indexed
        self.on_ids = on_ids
        self.dirty: set[ConsumeLog] = set()  # written since the last checkpoint
        #: Logs holding entries in memory (``ConsumeLog.read_held``), least recently used first.
        self._held: dict[ConsumeLog, None] = {}
        self.entries = 0
        #: Why the index step at ``indexed_offset`` failed; None while it keeps up.
        self.stalled: OSError | None = None
        self._retry_now: trio.Event | None = None  # set by ``run``: wakes it on a stall

    # ----------------------------------------------------------- start-up

    def open_existing(self, checkpoint_counts: dict[str, int]) -> None:
        """Open every consume log on disk (blocking; start-up).

        ``checkpoint_counts`` maps stems to the counts the last checkpoint fsynced.
        """
        for stem, subject in list_subjects(self.directory).items():
            self.logs[subject] = ConsumeLog.open(
                self.directory, subject, checkpoint_count=checkpoint_counts.get(stem, 0), files=self.files
            )
        missing = set(checkpoint_counts) - {subject_stem(s) for s in self.logs}
        missing = {stem for stem in missing if checkpoint_counts[stem] > 0}
        if missing:
            raise CorruptLog(f"consume logs {sorted(missing)} are in the checkpoint but not in {self.directory}")

    def replay(self, message_log: SegmentedLog, now: int, *, chunk: int = 4 << 20) -> int:
        """Index the message log from ``indexed_offset`` to its end (blocking; start-up).

        Progress records (a replicated master's consumer state) are passed over: the
        lmdb state holds what they hold. Returns the number of records replayed.
        """
        count = 0
        while True:
            data, _next_offset = message_log.read_raw(self.indexed_offset, chunk)
            if not data:
                break
            count += self.index_raw(data, self.indexed_offset, now)  # a disk error here fails the start-up
        for consume_log in self.logs.values():
            consume_log.finish_recovery()
        return count

    def index_raw(self, data: bytes, base: int, now: int, *, on_progress: Callable[[bytes], None] | None = None) -> int:
        """Index whole records read from the log at ``base`` (= ``indexed_offset``); hand each
        progress record's payload to ``on_progress`` in log order. Returns the messages indexed."""
        count = 0
        for kind, start, end in kind_runs(data):
            if kind == MESSAGE_KIND:
                batch = scan_batch(data[start:end], REPLAY_LIMITS)
                items = batch_items(batch, base + start, range(len(batch)))
                self._waiting[base + start] = (base + end, items, dedup_keys(batch), now)
                count += len(items)
            else:
                for span in iter_spans(data, start, end):  # checks each record's CRC
                    if span.kind == PROGRESS_KIND and on_progress is not None:
                        on_progress(data[span.start + HEADER_SIZE : span.end])
                self._waiting[base + start] = (base + end, [], [], now)
            self._advance()
        return count

    # ----------------------------------------------------------- indexing

    def consume_log(self, subject: str) -> ConsumeLog | None:
        return self.logs.get(subject)

    def count(self, subject: str) -> int:
        consume_log = self.logs.get(subject)
        return consume_log.count if consume_log is not None else 0

    def submit(self, base: int, end: int, items: list[Item], ids: list[str], stored_at: int) -> None:
        """Records ``[base, end)`` of the message log are durable: index them in order.

        Never fails for the disk: a failed step stalls the index and ``run`` retries it.
        """
        self._waiting[base] = (end, items, ids, stored_at)
        if self.stalled is None and base == self.indexed_offset:
            self._advance_or_stall()

    async def run(self, *, clock: Clock, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Retry a stalled index step with backoff until it succeeds, for as long as the server runs."""
        task_status.started()
        while True:
            if self.stalled is None:
                self._retry_now = trio.Event()
                await self._retry_now.wait()
                continue
            started = clock.monotonic_ms()
            backoff = BackoffRun(RETRY_BACKOFF)
            while self.stalled is not None:
                await clock.sleep_ms(backoff.next_delay_ms())
                self._advance_or_stall()  # the stalled step again, and the batches behind it
            log.info(
                "realtime: indexing goes on after %.1f s (%d retries); caught up to message-log offset %d",
                (clock.monotonic_ms() - started) / 1000,
                backoff.failures,
                self.indexed_offset,
            )

    def _advance_or_stall(self) -> None:
        try:
            self._advance()
        except OSError as error:
            if self.stalled is None:
                log.warning(
                    "realtime: indexing stopped at message-log offset %d: %s; the records are stored and "
                    "will be delivered: retrying until it succeeds",
                    self.indexed_offset,
                    describe(error),
                )
                if self._retry_now is not None:
                    self._retry_now.set()
            self.stalled = error
        else:
            self.stalled = None

    def _advance(self) -> None:
        """Index the waiting batches that are next in offset order (raises ``OSError`` from the disk)."""
        waiting = self._waiting
        while waiting:
            base = self.indexed_offset
            next_batch = waiting.get(base)
            if next_batch is None:
                break
            self._apply(*next_batch)
            del waiting[base]

    def _apply(self, end: int, items: list[Item], ids: list[str], stored_at: int) -> None:
        """Index one batch, all or nothing: after a failed write no consume log keeps an entry of it.

        An entry's time is ``stored_at``; a scheduled record (``deliver_at`` after
        ``created_at``) that came ahead of its ``deliver_at`` is flagged ``HELD`` with that
        moment rounded up to ``RELEASE_TICK_MS`` instead (``delaymq.realtime.delivery``)."""
        # subject -> (its log, its count before, its entries of the step)
        touched: dict[str, tuple[ConsumeLog, int, list[tuple[int, int, int, int]]]] = {}
        logs = self.logs
        latest_held = stored_at + MAX_AHEAD_MS
        try:
            for subject, offset, size, mask, release_at in items:
                step = touched.get(subject)
                if step is None:
                    consume_log = logs.get(subject)
                    if consume_log is None:
                        consume_log = logs[subject] = ConsumeLog.open(self.directory, subject, files=self.files)
                    step = touched[subject] = (consume_log, consume_log.count, [])
                if stored_at < release_at <= latest_held:  # sent ahead: held until its tick
                    step[2].append((offset, size, mask, HELD | -(-release_at // RELEASE_TICK_MS) * RELEASE_TICK_MS))
                else:
                    step[2].append((offset, size, mask, stored_at))
            for consume_log, _count, added in touched.values():
                consume_log.add_many(added)
                consume_log.write_pending()
        except OSError:
            for consume_log, count, _added in touched.values():
                consume_log.take_back(count)
            raise
        for consume_log, _count, _added in touched.values():
            self.dirty.add(consume_log)
            self.hold(consume_log)
        base, self.indexed_offset = self.indexed_offset, end
        self.entries += len(items)
        if self.on_ids is not None:
            self.on_ids(ids, stored_at, base)  # the records of ``ids`` start at ``base``, back to back
        if self.on_indexed is not None and touched:
            self.on_indexed(set(touched))

    def hold(self, consume_log: ConsumeLog) -> None:
        """``consume_log`` was just written or read: keep its entries in memory, and release the
        memory of the least recently used logs past ``HELD_LOGS``."""
        held = self._held
        held.pop(consume_log, None)
        held[consume_log] = None
        while len(held) > HELD_LOGS:
            oldest = next(iter(held))
            del held[oldest]
            oldest.release()

    @property
    def waiting(self) -> int:
        """Batches appended but not yet indexed (an earlier one is on its way, or the index stalled)."""
        return len(self._waiting)

    def take_dirty(self) -> list[ConsumeLog]:
        dirty = list(self.dirty)
        self.dirty.clear()
        return dirty

    def subjects_coming(self) -> set[str]:
        """Subjects of records appended and submitted but not indexed yet that have no consume log
        (a walk over the waiting batches: for counting new subjects, not for every SEND)."""
        logs = self.logs
        return {item[0] for _end, items, _ids, _at in self._waiting.values() for item in items if item[0] not in logs}

    def close(self, logs: Iterable[ConsumeLog] | None = None) -> None:
        for consume_log in self.logs.values() if logs is None else logs:
            consume_log.close()
        if logs is None:
            self.files.close()


__all__ = ["HELD_LOGS", "MAX_AHEAD_MS", "RELEASE_TICK_MS", "REPLAY_LIMITS", "Indexer", "Item", "batch_items"]
