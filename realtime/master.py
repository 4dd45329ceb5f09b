"""The realtime master: the recovered state of a data folder and the handlers over it.

``open_master`` brings the state back as a restart does (``recovery.recover``) and
builds a ``RealtimeMaster``; the server (``delaymq.realtime.server``) routes SEND,
PULL, ACK, NACK and CONSUMER_HEARTBEAT to it while the member is master. The parts,
each in a module of its own:

- ``send.SendHandler``: SEND, and storing batches (dedup, message log, index);
  ``fences.Fences`` refuses SENDs of a deposed scheduler master (``fenced``);
- ``pull.PullHandler``: PULL, long polls parked per subject (``parked``);
- ``acks.AckHandler``: ACK, NACK, CONSUMER_HEARTBEAT; ``retries.Retries`` sends
  nacked messages back through a scheduler or to the dead letters;
- ``consumers.Consumers``: consumer state (memory, lmdb) and pull logs;
- ``redelivery.RedeliverySweeper``: gives back what timed out;
- ``checkpoint.Committer``: snapshots of all their small state, into lmdb.

Under replication (``source``) each snapshot's consumer state is first appended to the
message log as a progress record (``delaymq.realtime.progress``) and, under sync
replication, waits for the in-sync slaves; so does every SEND, and a PULL's hand-outs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from delaymq.client.routes import RouteClient
from delaymq.clock import Clock
from delaymq.net.limits import Limits
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.realtime.acks import AckHandler
from delaymq.realtime.caps import DEFAULT_MAX_GROUPS, DEFAULT_MAX_SUBJECTS, SubjectCap
from delaymq.realtime.checkpoint import Committer, Snapshot, encode_consumer, encode_share, write_snapshot
from delaymq.realtime.consumelog import ENTRY_SIZE
from delaymq.realtime.consumers import Consumers
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.fences import Fences, load_fences
from delaymq.realtime.groups import Groups
from delaymq.realtime.index import Indexer
from delaymq.realtime.parked import ParkedPulls
from delaymq.realtime.progress import ConsumerProgress, Progress, ship_consumers, unship
from delaymq.realtime.pull import PullHandler
from delaymq.realtime.pulllog import PULL_ENTRY_SIZE
from delaymq.realtime.recovery import Storage, recover_storage
from delaymq.realtime.redelivery import RedeliverySweeper
from delaymq.realtime.retries import Retries
from delaymq.realtime.send import SendHandler
from delaymq.replication.source import ReplicationSource
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking
from delaymq.storage.writer import LogWriter

log = logging.getLogger(__name__)

#: At most this many (group, subject) pairs get a consumer-lag figure: those with the most lag.
MAX_LAG_SERIES = 100


class RealtimeMaster:
    """What a master serves from: the recovered state and the request handlers over it.

    Built by ``open_master`` from the data folder (as a restart does) each time a member
    becomes master; ``delaymq.realtime.server.RealtimeServer`` routes requests to it.
    """

    def __init__(
        self,
        *,
        group: str,
        clock: Clock,
        limits: Limits,
        message_log: SegmentedLog,
        store: StateStore,
        indexer: Indexer,
        dedup: DedupWindow,
        groups: Groups,
        pull_dir: Path,
        consume_dir: Path,
        dedup_buckets: list[int],
        fences: dict[str, int],
        run_blocking: RunBlocking,
        checkpoint_interval_ms: int = 1000,
        source: ReplicationSource | None = None,
        replication_timeout_ms: int = 5_000,
        pull_log_bytes: int = 0,
        max_subjects: int = DEFAULT_MAX_SUBJECTS,
        max_groups: int = DEFAULT_MAX_GROUPS,
    ) -> None:
        self.group = group
        #: Under replication (a managed member): consumer progress is shipped in the log.
        self.source = source
        self._replication_timeout_ms = replication_timeout_ms
        self._clock = clock
        self._log = message_log
        self._store = store
        self._indexer = indexer
        self._dedup = dedup
        self._groups = groups
        self._pull_dir = pull_dir
        self._consume_dir = consume_dir
        self._dedup_buckets = dedup_buckets
        #: Pull-log bytes on disk when this master started; the hand-outs since add to it.
        self._pull_log_bytes_at_start = pull_log_bytes
        #: How long each checkpoint write took (its consume-log, pull-log and lmdb fsyncs), µs.
        self.checkpoint_us = LatencyHistogram()
        self._checkpoint_ns = -1  # set by the worker thread that wrote, recorded on the trio side
        self.parked = ParkedPulls()
        self.sweeper = RedeliverySweeper(groups=groups, clock=clock, parked=self.parked)
        self.consumers = self._make_consumers(run_blocking=run_blocking, max_groups=max_groups)
        self.committer = self._make_committer(interval_ms=checkpoint_interval_ms, run_blocking=run_blocking)
        self.fences = Fences(store=store, run_blocking=run_blocking, durable=fences, clock=clock)
        self.send_handler = self._make_send_handler(limits=limits, run_blocking=run_blocking, max_subjects=max_subjects)
        self.pull_handler = self._make_pull_handler(limits=limits, run_blocking=run_blocking)
        self.retries = self._make_retries(run_blocking=run_blocking)
        self.ack_handler = self._make_ack_handler(limits=limits)
        indexer.on_indexed = self.parked.wake
        indexer.on_ids = dedup.indexed
        if source is not None:
            self._replicate_through(source)

    # --------------------------------------------------------------- parts

    def _make_consumers(self, *, run_blocking: RunBlocking, max_groups: int) -> Consumers:
        return Consumers(
            groups=self._groups,
            indexer=self._indexer,
            store=self._store,
            pull_dir=self._pull_dir,
            clock=self._clock,
            sweeper=self.sweeper,
            run_blocking=run_blocking,
            max_groups=max_groups,
        )

    def _make_committer(self, *, interval_ms: int, run_blocking: RunBlocking) -> Committer:
        return Committer(
            take=self._take_snapshot,
            write=self._write_snapshot,
            done=self._snapshot_done,
            failed=self._snapshot_failed,
            interval_ms=interval_ms,
            run_blocking=run_blocking,
        )

    def _make_send_handler(self, *, limits: Limits, run_blocking: RunBlocking, max_subjects: int) -> SendHandler:
        return SendHandler(
            clock=self._clock,
            limits=limits,
            store=self._store,
            indexer=self._indexer,
            dedup=self._dedup,
            fences=self.fences,
            run_blocking=run_blocking,
            subjects=SubjectCap(max_subjects, self._indexer, self._groups.shares, self._clock),
        )

    def _make_pull_handler(self, *, limits: Limits, run_blocking: RunBlocking) -> PullHandler:
        return PullHandler(
            consumers=self.consumers,
            groups=self._groups,
            indexer=self._indexer,
            parked=self.parked,
            sweeper=self.sweeper,
            message_log=self._log,
            clock=self._clock,
            limits=limits,
            run_blocking=run_blocking,
        )

    def _make_retries(self, *, run_blocking: RunBlocking) -> Retries:
        return Retries(
            groups=self._groups,
            indexer=self._indexer,
            message_log=self._log,
            sender=self.send_handler,
            clock=self._clock,
            run_blocking=run_blocking,
        )

    def _make_ack_handler(self, *, limits: Limits) -> AckHandler:
        return AckHandler(
            consumers=self.consumers,
            groups=self._groups,
            retries=self.retries,
            parked=self.parked,
            sweeper=self.sweeper,
            commit=self.committer.commit,
            clock=self._clock,
            limits=limits,
        )

    def _replicate_through(self, source: ReplicationSource) -> None:
        """Progress records go out with every checkpoint; what a consumer is answered waits for them."""
        self.committer.ship = partial(self.ship, wait=False)
        self.fences.on_raise = self._ship_fences
        self.fences.on_clear = self._ship_fence_clear
        self.send_handler.replicated = self._replicated
        if source.mode == "sync":
            self.ack_handler.replicated = partial(self._replicated, None)
            self.pull_handler.handed_out = self._hand_outs_replicated

    # --------------------------------------------------------------- public

    @property
    def writer(self) -> LogWriter | None:
        return self.send_handler.writer

    @writer.setter
    def writer(self, writer: LogWriter | None) -> None:
        self.send_handler.writer = writer

    def counters(self) -> dict[str, int]:
        """This master's counters, for ``RealtimeStatistics``."""
        groups = self._groups
        sent, pulled, retries = self.send_handler, self.pull_handler, self.retries
        return {
            "sends": sent.sends,
            "messages_stored": sent.stored,
            "duplicates": sent.duplicates,
            "pulls": pulled.pulls,
            "pulls_waiting": self.parked.count,
            "messages_delivered": pulled.delivered,
            "acks": groups.acks,
            "acked_messages": groups.acked_messages,
            "nacks": groups.nacks,
            "redeliveries": groups.redelivered,
            "released": groups.released,
            "retries_scheduled": retries.scheduled,
            "retries_stored": retries.stored,
            "dead_letters": retries.dead_letters,
            "retries_given_back": retries.given_back,
            "consumers": len(groups.live),
            "subjects": len(self._indexer.logs),
            "indexed_offset": self._indexer.indexed_offset,
            "dedup_ids_in_memory": len(self._dedup),
            "checkpoints": self.committer.commits,
            "checkpoint_failures": self.committer.failures,
            "fenced": self.fences.refused,
            "fence_raises": self.fences.raised,
            "subjects_over_cap": sent.subjects.over if sent.subjects is not None else 0,
        }

    def log_bytes(self) -> dict[str, int]:
        """Bytes of the consume logs (entries held) and the pull logs, without touching the disk."""
        consume = sum(consume_log.count for consume_log in self._indexer.logs.values()) * ENTRY_SIZE
        pull = self._pull_log_bytes_at_start + self._groups.pulled_entries * PULL_ENTRY_SIZE
        return {"consume": consume, "pull": pull}

    def consumer_lag(self) -> list[tuple[str, str, int]]:
        """(group, subject, messages not acked) of the ``MAX_LAG_SERIES`` pairs with the most lag."""
        counts = {subject: consume_log.count for subject, consume_log in self._indexer.logs.items()}
        lag = self._groups.lag(counts)
        top = sorted(lag.items(), key=lambda item: (-item[1], item[0]))[:MAX_LAG_SERIES]
        return [(group, subject, count) for (group, subject), count in top]

    async def indexer_run(self, *, clock: Clock, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Retries a stalled index step (``Indexer.run``)."""
        await self._indexer.run(clock=clock, task_status=task_status)

    def close(self) -> None:
        """Close the consume logs and pull logs (blocking, quick: file descriptors)."""
        self._indexer.close()
        self.consumers.close()

    # --------------------------------------------------------------- replication

    async def _replicated(self, end: int | None) -> None:
        """Return once the in-sync slaves hold the log below ``end`` (None: all of it so far;
        sync replication)."""
        assert self.source is not None
        if end is None:
            end = self._log.end_offset
        self.source.poke()
        await self.source.confirm_replicated(end, timeout_ms=self._replication_timeout_ms, what="the change")

    async def _hand_outs_replicated(self) -> None:
        """A hand-out is replicated before it goes, so a promoted slave hands it out again marked;
        a master whose writes wait for no slave (alone) only commits it with its next checkpoint."""
        assert self.source is not None
        if self.source.waits_for_slaves():
            await self.ack_handler.commit()

    async def ship(self, progress: Progress, *, wait: bool = True) -> None:
        """Append a progress record, then (``wait``) wait until it is replicated (sync).

        The append is shielded as a SEND's is: once handed to the writer the record may
        reach the log, and then the index must pass over it (it moves in offset order)."""
        assert self.writer is not None
        with trio.CancelScope(shield=True):
            end = 0
            for data in progress.records(self._log.max_record):
                try:
                    base = await self.writer.append(data)
                except StorageError as error:
                    raise storage_refusal("consumer progress could not be written to the message log", error) from error
                end = base + len(data)
                self._indexer.submit(base, end, [], [], self._clock.now_ms())  # the index passes over it
        if wait:
            await self._replicated(end)
        else:
            assert self.source is not None
            self.source.poke()

    async def _ship_fences(self, epochs: dict[str, int]) -> None:
        await self.ship(Progress(fences=dict(epochs)))

    async def _ship_fence_clear(self, group: str) -> None:
        await self.ship(Progress(clear=[group]))

    def full_progress(self, stored: list[tuple[bytes, bytes]]) -> Progress:
        """The master's whole state as one progress record (a new master session's first):
        every share, every consumer (``stored``: the committed records of those not in memory)."""
        groups = self._groups
        in_memory = [(consumer, encode_consumer(consumer)) for consumer in groups.consumers.values()]
        consumers = ship_consumers(in_memory, whole=True)
        consumers += [ConsumerProgress(key, record, 0, b"") for key, record in stored if key not in groups.consumers]
        return Progress(
            reset=True,
            shares=[(share.key, encode_share(share)) for share in groups.shares.values()],
            consumers=consumers,
            fences=self.fences.table(),
        )

    # --------------------------------------------------------------- checkpoints

    def _take_snapshot(self) -> Snapshot:
        shares, consumers = self._groups.take_dirty()
        pull_logs = self.consumers.take_written()
        snapshot = Snapshot(
            index_offset=self._indexer.indexed_offset,
            consume=[(consume_log, consume_log.count) for consume_log in self._indexer.take_dirty()],
            pull_logs=pull_logs,
            dedup_ids=self._dedup.take_unpersisted(),
            shares=[(share, encode_share(share)) for share in shares],
            consumers=[(consumer, encode_consumer(consumer)) for consumer in consumers],
            now=self._clock.now_ms(),
        )
        if self.source is not None and (snapshot.shares or snapshot.consumers):
            snapshot.ship = Progress(
                shares=[(share.key, record) for share, record in snapshot.shares],
                consumers=ship_consumers(snapshot.consumers),
            )
        return snapshot

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        started = time.perf_counter_ns()
        write_snapshot(
            snapshot,
            store=self._store,
            message_log=self._log,
            consume_dir=self._consume_dir,
            pull_dir=self._pull_dir,
            dedup_buckets=self._dedup_buckets,
            window_ms=self._dedup.window_ms,
        )
        self._checkpoint_ns = time.perf_counter_ns() - started

    def _snapshot_done(self, snapshot: Snapshot) -> None:
        if self._checkpoint_ns >= 0:  # the committer writes one snapshot at a time
            self.checkpoint_us.record(self._checkpoint_ns // 1000)
            self._checkpoint_ns = -1
        self._dedup.committed(snapshot.dedup_ids, self._clock.now_ms())
        self.consumers.forget_idle()

    def _snapshot_failed(self, snapshot: Snapshot) -> None:
        self._dedup.restore_unpersisted(snapshot.dedup_ids)
        self._groups.dirty_shares.update(share for share, _ in snapshot.shares)
        self._groups.dirty_consumers.update(consumer for consumer, _ in snapshot.consumers)
        self._indexer.dirty.update(consume_log for consume_log, _ in snapshot.consume)
        self.consumers.restore_written(snapshot.pull_logs)
        if snapshot.ship is not None:
            unship(snapshot.consumers, snapshot.ship)


def open_master(
    storage: Storage,
    *,
    group: str,
    clock: Clock,
    limits: Limits,
    settings: MasterSettings,
    run_blocking: RunBlocking,
    source: ReplicationSource | None = None,
    scheduler_routes: RouteClient | None = None,
) -> RealtimeMaster:
    """Recover the data folder's state and build a master over it (blocking: a worker thread)."""
    groups = Groups(ack_timeout_ms=settings.ack_timeout_ms, consumer_timeout_ms=settings.consumer_timeout_ms)
    start_ms = clock.now_ms()
    dedup = DedupWindow(window_ms=settings.dedup_window_ms, memory_ids=settings.dedup_memory_ids, covers_from=start_ms)
    indexer, dedup_buckets, in_flight = recover_storage(storage, groups=groups, dedup=dedup, now=start_ms)
    try:
        master = RealtimeMaster(
            group=group,
            clock=clock,
            limits=limits,
            message_log=storage.message_log,
            store=storage.store,
            indexer=indexer,
            dedup=dedup,
            groups=groups,
            pull_dir=storage.pull_folder.path,
            consume_dir=storage.consume_folder.path,
            dedup_buckets=dedup_buckets,
            fences=load_fences(storage.store),
            run_blocking=run_blocking,
            checkpoint_interval_ms=settings.checkpoint_interval_ms,
            source=source,
            replication_timeout_ms=settings.replication_timeout_ms,
            pull_log_bytes=_pull_log_bytes(storage.pull_folder.path),
            max_subjects=settings.max_subjects,
            max_groups=settings.max_groups,
        )
    except BaseException:
        indexer.close()
        raise
    master.retries.scheduler_routes = scheduler_routes
    now = clock.monotonic_ms()  # the groups' timeouts are intervals: a wall-clock step must not fire them
    for consumer, pull_log in in_flight:
        master.consumers.adopt(consumer, pull_log, now)
    return master


def _pull_log_bytes(pull_dir: Path) -> int:
    """Bytes of the pull logs on disk (blocking; once, when a master starts: the hand-outs count on)."""
    total = 0
    with os.scandir(pull_dir) as found:
        for entry in found:
            if entry.name.endswith(".log"):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    pass
    return total


@dataclass(frozen=True, slots=True)
class MasterSettings:
    """A realtime server's options that shape its master (``open_realtime_server`` checks them)."""

    dedup_window_ms: int = 600_000
    dedup_memory_ids: int = 100_000
    ack_timeout_ms: int = 60_000
    consumer_timeout_ms: int = 30_000
    checkpoint_interval_ms: int = 1000
    replication_timeout_ms: int = 5_000
    max_subjects: int = DEFAULT_MAX_SUBJECTS  # subjects SENDs may make (``caps``)
    max_groups: int = DEFAULT_MAX_GROUPS  # consumer groups per subject PULLs may make (``caps``)


__all__ = ["MasterSettings", "RealtimeMaster", "open_master"]
