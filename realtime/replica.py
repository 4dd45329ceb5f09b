"""A realtime slave's copy of the state: its own consume logs, and the master's consumer progress.

The fetcher (``delaymq.replication.fetcher``) appends the master's message log here byte
for byte. ``ReplicaState.step`` then reads what arrived past the index checkpoint, in
log order: message records are indexed into consume logs exactly as the master indexed
them (same order, so the same consume-log sequences), and the progress records
(``delaymq.realtime.progress``) are applied: pull-log entries written where the master
wrote them, share, consumer and fence records committed as the master committed them.
Each step ends with one checkpoint (``checkpoint.write_snapshot``) holding the index
offset, the consume-log counts, the dedup ids and the applied records, so a slave that
restarts goes on from there, and one that is promoted opens its data folder as a
restarted master would.

Blocking: steps run in a worker thread, one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from delaymq.realtime.checkpoint import CONSUMERS_DB, Snapshot, decode_consumer, write_snapshot
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.groups import Groups
from delaymq.realtime.index import Indexer
from delaymq.realtime.progress import Progress
from delaymq.realtime.pulllog import PullLog, list_pull_logs
from delaymq.realtime.recovery import Storage, recover_storage

DEFAULT_STEP_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ReplicaStep:
    idle: bool
    messages: int = 0  # message records indexed
    progress: int = 0  # progress records applied


class ReplicaState:
    """A slave's indexer, dedup ids and applied progress over one data folder."""

    def __init__(
        self, storage: Storage, *, indexer: Indexer, dedup: DedupWindow, dedup_buckets: list[int], slave: bool
    ) -> None:
        self._storage = storage
        #: A slave hands nothing out: pull-log entries past what the master says are cut.
        self.slave = slave
        self.indexer = indexer
        self._dedup = dedup
        self._dedup_buckets = dedup_buckets
        self.messages = 0
        self.progress = 0

    @classmethod
    def open(
        cls, storage: Storage, *, now: int, dedup_window_ms: int, dedup_memory_ids: int, slave: bool = True
    ) -> ReplicaState:
        """The folder's state as committed (blocking); records past the checkpoint are left to ``step``.

        A ``slave`` hands nothing out: pull-log entries past a consumer's committed length
        are a deposed master's hand-outs the group never had, and are cut (a restarted
        master keeps them: recovery makes them hand-outs in flight)."""
        if slave:
            cut_pull_tails(storage)
        dedup = DedupWindow(window_ms=dedup_window_ms, memory_ids=dedup_memory_ids, covers_from=now)
        groups = Groups(ack_timeout_ms=1, consumer_timeout_ms=1)  # a slave hands nothing out
        indexer, buckets, _in_flight = recover_storage(storage, groups=groups, dedup=dedup, now=now, replay=False)
        indexer.on_ids = dedup.indexed
        return cls(storage, indexer=indexer, dedup=dedup, dedup_buckets=buckets, slave=slave)

    @property
    def applied_offset(self) -> int:
        """The log below this offset is indexed and applied (and committed once ``step`` returns)."""
        return self.indexer.indexed_offset

    def step(self, *, until: int, now: int, max_bytes: int = DEFAULT_STEP_BYTES) -> ReplicaStep:
        """Index and apply the records from ``applied_offset`` up to ``until``, at most ``max_bytes``
        (whole records), and commit them. Raises ``OSError``/``StorageError`` from the disk: the
        caller then opens the state again (what this step did in memory is not committed)."""
        storage = self._storage
        offset = self.indexer.indexed_offset
        if offset >= until:
            return ReplicaStep(idle=True)
        data, _next = storage.message_log.read_raw(offset, min(max_bytes, until - offset))
        if not data:
            return ReplicaStep(idle=True)
        applied = AppliedProgress(storage.pull_folder.path, slave=self.slave)
        messages = self.indexer.index_raw(data, offset, now, on_progress=applied.apply)
        self._commit(applied, now)
        self.messages += messages
        self.progress += applied.count
        return ReplicaStep(idle=False, messages=messages, progress=applied.count)

    def _commit(self, applied: AppliedProgress, now: int) -> None:
        """One checkpoint of what a step indexed and applied (blocking)."""
        storage = self._storage
        snapshot = Snapshot(
            index_offset=self.indexer.indexed_offset,
            consume=[(consume_log, consume_log.count) for consume_log in self.indexer.take_dirty()],
            pull_logs=list(applied.pull_logs.values()),
            dedup_ids=self._dedup.take_unpersisted(),
            shares=[],
            consumers=[],
            now=now,
            records=None if applied.records.empty() else applied.records,
        )
        write_snapshot(
            snapshot,
            store=storage.store,
            message_log=storage.message_log,
            consume_dir=storage.consume_folder.path,
            pull_dir=storage.pull_folder.path,
            dedup_buckets=self._dedup_buckets,
            window_ms=self._dedup.window_ms,
        )
        self._dedup.committed(snapshot.dedup_ids, now)

    def catch_up(self, *, until: int, now: int) -> int:
        """Steps until ``until`` is applied (a promotion); returns the progress records applied."""
        before = self.progress
        while not self.step(until=until, now=now).idle:
            pass
        return self.progress - before

    def close(self) -> None:
        self.indexer.close()


class AppliedProgress:
    """The master's progress records of one step, merged into one to commit, and the
    pull-log entries they wrote (blocking: the step's worker thread)."""

    def __init__(self, pull_dir: Path, *, slave: bool) -> None:
        self._pull_dir = pull_dir
        self._slave = slave
        self.records = Progress()
        self.pull_logs: dict[bytes, PullLog] = {}
        self.count = 0  # progress records applied

    def apply(self, payload: bytes) -> None:
        """Apply one progress record (the indexer's ``on_progress``)."""
        progress = Progress.decode(payload)
        self.count += 1
        applied = self.records
        if progress.reset:
            self._reset(progress)
        applied.shares.extend(progress.shares)
        applied.consumers.extend(progress.consumers)
        if applied.keep is not None:  # upserts after a reset stay
            applied.keep[0].update(key for key, _ in progress.shares)
            applied.keep[1].update(c.key for c in progress.consumers)
        for group in progress.clear:  # an admin's CLEAR_FENCE: raises before it are void
            applied.fences.pop(group, None)
            if group not in applied.clear:
                applied.clear.append(group)
        for group, epoch in progress.fences.items():
            applied.fences[group] = max(epoch, applied.fences.get(group, 0))
        self._write_pull_logs(progress)

    def _reset(self, progress: Progress) -> None:
        """The master's whole state: what it does not keep goes."""
        applied = self.records
        keep_shares, keep_consumers = (set(keys) for keys in progress.kept())
        applied.shares[:] = [(key, record) for key, record in applied.shares if key in keep_shares]
        applied.consumers[:] = [c for c in applied.consumers if c.key in keep_consumers]
        applied.reset, applied.keep = True, (keep_shares, keep_consumers)
        for stem in list_pull_logs(self._pull_dir) if self._slave else ():
            if bytes.fromhex(stem) not in keep_consumers:
                self._pull_log_of(bytes.fromhex(stem)).truncate(0)

    def _write_pull_logs(self, progress: Progress) -> None:
        """Write each consumer's hand-outs where the master wrote them."""
        for consumer in progress.consumers:
            names = decode_consumer(consumer.record)
            pull_log = self._pull_log_of(consumer.key)
            if consumer.entries:
                pull_log.create(names["subject"], names["group"], names["consumer"], broadcast=bool(names["broadcast"]))
                pull_log.write(consumer.first, consumer.entries)
            if self._slave:
                # Entries past the master's length are this member's own from a former life as
                # master (hand-outs it made and never replicated): the group never had them.
                pull_log.truncate(names["length"])

    def _pull_log_of(self, key: bytes) -> PullLog:
        pull_log = self.pull_logs.get(key)
        if pull_log is None:
            pull_log = self.pull_logs[key] = PullLog(self._pull_dir, key.hex())
        return pull_log


def cut_pull_tails(storage: Storage) -> int:
    """Cut every pull log to its consumer's committed length (0 without a record); returns how many were cut."""
    lengths = {key.hex(): decode_consumer(record)["length"] for key, record in storage.store.items(CONSUMERS_DB)}
    cut = 0
    for stem in list_pull_logs(storage.pull_folder.path):
        pull_log = PullLog(storage.pull_folder.path, stem)
        if pull_log.truncate(lengths.get(stem, 0)):
            cut += 1
    return cut


__all__ = ["DEFAULT_STEP_BYTES", "ReplicaState", "ReplicaStep", "cut_pull_tails"]
