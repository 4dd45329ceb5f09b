"""Checkpoints: the realtime server's small state, committed to lmdb as one snapshot.

A snapshot is taken in the event loop in one go (so it is consistent: positions
never point past the consume-log counts it holds, acks never past the pull-log
lengths) and written by a worker thread in this order:

1. fsync the message log (under ``async`` flush it may lag the index),
2. fsync the consume logs and pull logs written since the last snapshot (and
   their folders when a file is new),
3. one lmdb write transaction: index offset, consume-log counts, new dedup ids,
   shares and consumers.

So whatever a committed snapshot points at is on disk, and after a crash the
state is the last snapshot's, consistent with the files. ACK answers wait for
the snapshot holding them (``Committer.commit``); the rest (pulls, the index
checkpoint, dedup ids) is committed every ``interval``.

lmdb layout (named dbs; records are msgpack maps so outside tools read them)::

    meta            b"index_offset" -> u64 BE: message-log offset indexed (and fsynced) below
    consume_counts  consume-log stem (16 bytes) -> u64 BE: entries fsynced at that offset
    shares          share key (16 bytes) -> {subject, group, broadcast_consumer,
                                             position, redeliver: [seq, redeliveries, ...],
                                             skip: [seq, ...]}
    consumers       consumer stem (16 bytes) -> {subject, group, consumer, broadcast,
                                                 acked, length, done: [[start, end], ...]}
    dedup_*         see ``delaymq.realtime.dedup``
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from delaymq.protocol.ranges import AckRanges
from delaymq.realtime import dedup
from delaymq.realtime.consumelog import ConsumeLog, subject_stem
from delaymq.realtime.fences import FENCES_DB
from delaymq.realtime.groups import ConsumerState, Share
from delaymq.realtime.progress import Progress
from delaymq.realtime.pulllog import PullLog
from delaymq.storage.errors import StorageError, describe
from delaymq.storage.folder import fsync_directory
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore, WriteBatch, pack, unpack
from delaymq.storage.threads import RunBlocking

log = logging.getLogger(__name__)

META_DB = "meta"
COUNTS_DB = "consume_counts"
SHARES_DB = "shares"
CONSUMERS_DB = "consumers"
_INDEX_OFFSET = b"index_offset"
_U64 = struct.Struct(">Q")


def share_key(subject: str, group: str, broadcast_consumer: str | None) -> bytes:
    parts = [subject, group] if broadcast_consumer is None else [subject, group, broadcast_consumer]
    person = b"dq-share" if broadcast_consumer is None else b"dq-broadcast"
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=16, person=person).digest()


# ----------------------------------------------------------------- records


def encode_share(share: Share) -> bytes:
    flat: list[int] = []
    for sequence, redeliveries in share.redeliver:
        flat.append(sequence)
        flat.append(redeliveries)
    return pack(
        {
            "subject": share.subject,
            "group": share.group,
            "broadcast_consumer": share.broadcast_consumer,
            "position": share.position,
            "redeliver": flat,
            "skip": sorted(share.skip),
        }
    )


def decode_share(key: bytes, data: bytes) -> Share:
    record = unpack(data)
    share = Share(key, record["subject"], record["group"], record["broadcast_consumer"], record["position"])
    flat = record["redeliver"]
    share.redeliver.extend(zip(flat[0::2], flat[1::2]))
    share.skip.update(record.get("skip", ()))  # absent in records written before it existed
    return share


def encode_consumer(consumer: ConsumerState) -> bytes:
    return pack(
        {
            "subject": consumer.subject,
            "group": consumer.group,
            "consumer": consumer.consumer,
            "broadcast": consumer.broadcast,
            "acked": consumer.progress.acked,
            "length": consumer.length,
            "done": [list(r) for r in consumer.progress.ranges()],
        }
    )


def decode_consumer(data: bytes) -> dict[str, Any]:
    record: dict[str, Any] = unpack(data)
    return record


def consumer_from_record(
    key: bytes, record: dict[str, Any], share: Share, sequences: list[int], redeliveries: list[int]
) -> ConsumerState:
    """A consumer as committed, with its pull-log entries ``[acked, length)``."""
    consumer = ConsumerState(key, record["subject"], record["group"], record["consumer"], share)
    consumer.length = consumer.shipped = record["length"]
    consumer.progress = AckRanges(record["acked"], [(start, end) for start, end in record["done"]])
    consumer.window_base = record["acked"]
    consumer.sequences.extend(sequences)
    consumer.redeliveries.extend(redeliveries)
    return consumer


# ----------------------------------------------------------------- loading


@dataclass
class LoadedState:
    index_offset: int
    consume_counts: dict[str, int]
    shares: dict[bytes, Share]
    consumers: dict[bytes, dict[str, Any]]
    dedup_buckets: list[int]


def load_index_offset(store: StateStore) -> int:
    """The message-log offset the last checkpoint indexed below."""
    raw = store.get(META_DB, _INDEX_OFFSET)
    return _U64.unpack(raw)[0] if raw is not None else 0


def load_state(store: StateStore) -> LoadedState:
    """Everything the last checkpoint committed (blocking; start-up)."""
    index_offset = load_index_offset(store)
    counts = {key.hex(): _U64.unpack(value)[0] for key, value in store.items(COUNTS_DB)}
    shares = {key: decode_share(key, value) for key, value in store.items(SHARES_DB)}
    consumers = {key: decode_consumer(value) for key, value in store.items(CONSUMERS_DB)}
    return LoadedState(index_offset, counts, shares, consumers, dedup.load_buckets(store))


def load_consumer(store: StateStore, key: bytes) -> dict[str, Any] | None:
    raw = store.get(CONSUMERS_DB, key)
    return decode_consumer(raw) if raw is not None else None


# ----------------------------------------------------------------- writing


@dataclass
class Snapshot:
    """What one checkpoint writes; taken in the event loop, written in a thread."""

    index_offset: int
    consume: list[tuple[ConsumeLog, int]]
    pull_logs: list[PullLog]
    dedup_ids: list[tuple[list[str], int]]  # batches: (ids, stored_at)
    shares: list[tuple[Share, bytes]]
    consumers: list[tuple[ConsumerState, bytes]]
    now: int
    #: Under replication: the progress record the master appends (and has replicated) first.
    ship: Progress | None = None
    #: On a slave: state records out of the master's progress records, written as they are.
    records: Progress | None = None
    # Filled by the writer.
    pruned: int = 0
    folders: set[Any] = field(default_factory=set)

    def empty(self) -> bool:
        return not (self.consume or self.pull_logs or self.dedup_ids or self.shares or self.consumers or self.records)


def write_snapshot(
    snapshot: Snapshot,
    *,
    store: StateStore,
    message_log: SegmentedLog,
    consume_dir: Any,
    pull_dir: Any,
    dedup_buckets: list[int],
    window_ms: int,
) -> None:
    """Make a snapshot durable (blocking: a worker thread). See the module docstring."""
    message_log.flush()
    folders = set()
    for consume_log, _count in snapshot.consume:
        if consume_log.flush():
            folders.add(consume_dir)
    for pull_log in snapshot.pull_logs:
        if pull_log.flush():
            folders.add(pull_dir)
    for folder in folders:
        fsync_directory(folder)
    with store.write() as batch:
        batch.put(META_DB, _INDEX_OFFSET, _U64.pack(snapshot.index_offset))
        for consume_log, count in snapshot.consume:
            batch.put(COUNTS_DB, bytes.fromhex(subject_stem(consume_log.subject)), _U64.pack(count))
        for bucket in dedup.write_ids(batch, snapshot.dedup_ids):
            if bucket not in dedup_buckets:
                # Kept sorted: new buckets are almost always the newest.
                index = len(dedup_buckets)
                while index and dedup_buckets[index - 1] > bucket:
                    index -= 1
                dedup_buckets.insert(index, bucket)
        for share, record in snapshot.shares:
            batch.put(SHARES_DB, share.key, record)
        for consumer, record in snapshot.consumers:
            batch.put(CONSUMERS_DB, consumer.key, record)
        if snapshot.records is not None:
            _write_records(store, batch, snapshot.records)
    snapshot.pruned = dedup.prune(store, dedup_buckets, snapshot.now, window_ms)


def _write_records(store: StateStore, batch: WriteBatch, records: Progress) -> None:
    """A slave's state records (``delaymq.realtime.progress``); a reset deletes the keys it does not keep."""
    if records.reset:
        keep_shares, keep_consumers = records.kept()
        for db, keys in ((SHARES_DB, keep_shares), (CONSUMERS_DB, keep_consumers)):
            for key, _value in store.items(db):
                if key not in keys:
                    batch.delete(db, key)
    for key, record in records.shares:
        batch.put(SHARES_DB, key, record)
    for consumer in records.consumers:
        batch.put(CONSUMERS_DB, consumer.key, consumer.record)
    for group in records.clear:
        batch.delete(FENCES_DB, group.encode())
    for group, epoch in records.fences.items():
        raw = None if group in records.clear else store.get(FENCES_DB, group.encode())
        if raw is None or _U64.unpack(raw)[0] < epoch:
            batch.put(FENCES_DB, group.encode(), _U64.pack(epoch))


class Committer:
    """Takes and writes snapshots: every ``interval_ms``, and whenever an ACK waits for one."""

    def __init__(
        self,
        *,
        take: Callable[[], Snapshot],
        write: Callable[[Snapshot], None],
        done: Callable[[Snapshot], None],
        failed: Callable[[Snapshot], None],
        interval_ms: int,
        run_blocking: RunBlocking,
        ship: Callable[[Progress], Awaitable[None]] | None = None,
    ) -> None:
        self._run_blocking = run_blocking
        #: Under replication: append a snapshot's progress record and wait until it is replicated.
        self.ship = ship
        self._take = take
        self._write = write
        self._done = done
        self._failed = failed
        self._interval = interval_ms / 1000
        self._wanted = trio.Event()
        self._progress = trio.Event()
        self._taken = 0  # snapshots taken
        self._finished = 0  # snapshots written (or failed)
        self._failures: dict[int, BaseException] = {}
        self._lock = trio.Lock()
        self.commits = 0
        self.failures = 0
        self._failing = 0  # failures since the last snapshot written (logged once per outage)
        self._closed: Exception | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(self._interval):
                await self._wanted.wait()
            await self.commit_now()

    async def commit(self) -> None:
        """Return once a snapshot taken after this call is durable (raise if it failed, or if
        the committer was closed before it was taken)."""
        needed = self._taken + 1
        self._wanted.set()
        while self._finished < needed:
            if self._closed is not None:
                raise self._closed
            await self._progress.wait()
        error = self._failures.get(needed)
        if error is not None:
            raise error

    def close(self, error: Exception) -> None:
        """No more snapshots (the master session ended): waiting and later ``commit`` calls raise ``error``."""
        self._closed = error
        progress, self._progress = self._progress, trio.Event()
        progress.set()

    async def commit_now(self) -> None:
        """Take and write one snapshot now (the run loop; and the final one on close)."""
        async with self._lock:
            self._wanted = trio.Event()
            snapshot = self._take()
            self._taken += 1
            number = self._taken
            try:
                if not snapshot.empty():
                    if self.ship is not None and snapshot.ship is not None and not snapshot.ship.empty():
                        await self.ship(snapshot.ship)
                    # Not cancellable: once taken, a snapshot is written or restored.
                    with trio.CancelScope(shield=True):
                        await self._run_blocking(partial(self._write, snapshot))
                    self.commits += 1
                    if self._failing:
                        log.info("realtime checkpoint written again after %d failure(s)", self._failing)
                        self._failing = 0
            except Exception as error:
                self.failures += 1
                self._failing += 1
                if self._failing == 1:  # once per outage, not at every interval
                    log.warning(
                        "realtime checkpoint failed: %s; its changes go into the next one, retried until written",
                        describe(error),
                        exc_info=not isinstance(error, StorageError | OSError),  # a bug: show where
                    )
                self._failures[number] = error
                self._failed(snapshot)
            except BaseException:  # cancelled while shipping: nothing of it was committed
                self._failures[number] = RuntimeError("the checkpoint was cancelled (the master session ended)")
                self._failed(snapshot)
                raise
            else:
                self._done(snapshot)
            finally:
                self._finished = number
                self._failures = {n: e for n, e in self._failures.items() if n > number - 64}
                progress, self._progress = self._progress, trio.Event()
                progress.set()


__all__ = [
    "Committer",
    "LoadedState",
    "Snapshot",
    "consumer_from_record",
    "decode_share",
    "encode_consumer",
    "encode_share",
    "load_consumer",
    "load_index_offset",
    "load_state",
    "share_key",
    "write_snapshot",
]
