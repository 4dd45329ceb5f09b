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

from delaymq.realtime.checkpoint import Snapshot, decode_consumer, write_snapshot
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.groups import Groups
from delaymq.realtime.index import Indexer
from delaymq.realtime.progress import Progress
from delaymq.realtime.pulllog import PullLog
from delaymq.realtime.recovery import Storage, recover_storage

DEFAULT_STEP_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class ReplicaStep:
    idle: bool
    messages: int = 0  # message records indexed
    progress: int = 0  # progress records applied


class ReplicaState:
    """A slave's indexer, dedup ids and applied progress over one data folder."""

    def __init__(self, storage: Storage, *, indexer: Indexer, dedup: DedupWindow, dedup_buckets: list[int]) -> None:
        self._storage = storage
        self.indexer = indexer
        self._dedup = dedup
        self._dedup_buckets = dedup_buckets
        self.messages = 0
        self.progress = 0

    @classmethod
    def open(cls, storage: Storage, *, now: int, dedup_window_ms: int, dedup_memory_ids: int) -> ReplicaState:
        """The folder's state as committed (blocking); records past the checkpoint are left to ``step``."""
        dedup = DedupWindow(window_ms=dedup_window_ms, memory_ids=dedup_memory_ids, covers_from=now)
        groups = Groups(ack_timeout_ms=1, consumer_timeout_ms=1)  # a slave hands nothing out
        indexer, buckets, _in_flight = recover_storage(storage, groups=groups, dedup=dedup, now=now, replay=False)
        indexer.on_ids = dedup.indexed
        return cls(storage, indexer=indexer, dedup=dedup, dedup_buckets=buckets)

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
        applied = Progress()
        pull_logs: dict[bytes, PullLog] = {}
        count = 0

        def apply(payload: bytes) -> None:
            nonlocal count
            progress = Progress.decode(payload)
            count += 1
            if progress.reset:  # the master's whole state: what came before it is superseded
                applied.reset = True
                applied.shares.clear()
                applied.consumers.clear()
            applied.shares.extend(progress.shares)
            applied.consumers.extend(progress.consumers)
            for group, epoch in progress.fences.items():
                applied.fences[group] = max(epoch, applied.fences.get(group, 0))
            for consumer in progress.consumers:
                if consumer.entries:
                    pull_log = pull_logs.get(consumer.key)
                    if pull_log is None:
                        pull_log = pull_logs[consumer.key] = PullLog(storage.pull_folder.path, consumer.key.hex())
                        names = decode_consumer(consumer.record)
                        pull_log.create(
                            names["subject"], names["group"], names["consumer"], broadcast=bool(names["broadcast"])
                        )
                    pull_log.write(consumer.first, consumer.entries)

        messages = self.indexer.index_raw(data, offset, now, on_progress=apply)
        snapshot = Snapshot(
            index_offset=self.indexer.indexed_offset,
            consume=[(consume_log, consume_log.count) for consume_log in self.indexer.take_dirty()],
            pull_logs=list(pull_logs.values()),
            dedup_ids=self._dedup.take_unpersisted(),
            shares=[],
            consumers=[],
            now=now,
            records=None if applied.empty() else applied,
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
        self.messages += messages
        self.progress += count
        return ReplicaStep(idle=False, messages=messages, progress=count)

    def catch_up(self, *, until: int, now: int) -> int:
        """Steps until ``until`` is applied (a promotion); returns the progress records applied."""
        before = self.progress
        while not self.step(until=until, now=now).idle:
            pass
        return self.progress - before

    def close(self) -> None:
        self.indexer.close()


__all__ = ["DEFAULT_STEP_BYTES", "ReplicaState", "ReplicaStep"]
