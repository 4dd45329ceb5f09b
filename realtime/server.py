"""The realtime server: SEND, PULL, ACK, NACK and CONSUMER_HEARTBEAT over the shared transport.

``open_realtime_server`` opens the data folder (``recovery.open_storage``),
catches the consume logs up with the message log, then serves until its block
ends (``delaymq.protocol.serving``). Start-up and shutdown order follow the
nesting: the log writer outlives the handlers, and a last checkpoint is written
after both. Every blocking call (fsync, lmdb, reads) goes through the
``run_blocking`` it is given.

``RealtimeServer`` puts the parts together, each in a module of its own:

- ``send.SendHandler``: SEND, and storing batches (dedup, message log, index);
  ``fences.Fences`` refuses SENDs of a deposed scheduler master (``fenced``);
- ``pull.PullHandler``: PULL, long polls parked per subject (``parked``);
- ``acks.AckHandler``: ACK, NACK, CONSUMER_HEARTBEAT; ``retries.Retries`` sends
  nacked messages back through a scheduler or to the dead letters;
- ``consumers.Consumers``: consumer state (memory, lmdb) and pull logs;
- ``redelivery.RedeliverySweeper``: gives back what timed out;
- ``checkpoint.Committer``: snapshots of all their small state, into lmdb.

STATUS (command 14, as the scheduler's) takes no metadata and answers
``{group, address, now_ms, fences: {scheduler group: epoch}, statistics: {...}}``:
``fences`` is the durable fence table, ``statistics`` ``RealtimeStatistics`` as a map.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.client.registration import Registration, start_registration
from delaymq.client.routes import RouteClient, meta_addresses
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.routes import ServerKind
from delaymq.protocol.serving import serve_frames
from delaymq.protocol.transport import FrameServer, Peers, Request, split_listen
from delaymq.realtime.acks import AckHandler
from delaymq.realtime.checkpoint import Committer, Snapshot, encode_consumer, encode_share, write_snapshot
from delaymq.realtime.consumers import Consumers
from delaymq.realtime.dedup import DedupWindow
from delaymq.realtime.fences import Fences, load_fences
from delaymq.realtime.groups import Groups
from delaymq.realtime.index import Indexer
from delaymq.realtime.parked import ParkedPulls
from delaymq.realtime.pull import PullHandler
from delaymq.realtime.recovery import open_storage, recover
from delaymq.realtime.redelivery import RedeliverySweeper
from delaymq.realtime.retries import Retries
from delaymq.realtime.send import SendHandler
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, SegmentedLog, check_max_record
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.storage.writer import FlushPolicy, open_log_writer
from delaymq.wheel.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RealtimeStatistics:
    """A snapshot of a realtime server's counters."""

    address: str
    group: str
    sends: int  # SEND requests answered
    messages_stored: int
    duplicates: int  # records answered "duplicate"
    pulls: int  # PULL requests answered
    pulls_waiting: int  # long polls parked right now
    messages_delivered: int  # records handed out, redeliveries included
    acks: int
    nacks: int
    redeliveries: int  # messages given back to their group (timeouts, dead consumers, nacks)
    retries_scheduled: int  # nacked messages a scheduler took, to come back after their delay
    retries_stored: int  # nacked messages retried at once (delay 0), appended here
    dead_letters: int  # nacked messages of a last attempt, appended to their dead-letter subject
    retries_given_back: int  # nacked messages no scheduler took: given back to the group at once
    consumers: int  # consumers alive (pulled or heartbeated within the consumer timeout)
    subjects: int
    message_log_end: int
    indexed_offset: int
    dedup_ids_in_memory: int
    checkpoints: int
    checkpoint_failures: int
    fenced: int  # SENDs refused for an older epoch of their scheduler group
    fence_raises: int  # scheduler groups' epochs raised (committed) since start


class RealtimeServer:
    """One realtime server group. Build it with ``open_realtime_server``."""

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
    ) -> None:
        self.group = group
        self.address = ""
        self.registration: Registration | None = None
        self.crashed = False
        self._life: trio.CancelScope | None = None
        self._clock = clock
        self._log = message_log
        self._store = store
        self._indexer = indexer
        self._dedup = dedup
        self._groups = groups
        self._pull_dir = pull_dir
        self._consume_dir = consume_dir
        self._dedup_buckets = dedup_buckets
        self.parked = ParkedPulls()
        self.sweeper = RedeliverySweeper(groups=groups, clock=clock, parked=self.parked)
        self.consumers = Consumers(
            groups=groups,
            indexer=indexer,
            store=store,
            pull_dir=pull_dir,
            clock=clock,
            sweeper=self.sweeper,
            run_blocking=run_blocking,
        )
        self.committer = Committer(
            take=self._take_snapshot,
            write=self._write_snapshot,
            done=self._snapshot_done,
            failed=self._snapshot_failed,
            interval_ms=checkpoint_interval_ms,
            run_blocking=run_blocking,
        )
        self.fences = Fences(store=store, run_blocking=run_blocking, durable=fences)
        self.send_handler = SendHandler(
            clock=clock,
            limits=limits,
            store=store,
            indexer=indexer,
            dedup=dedup,
            fences=self.fences,
            run_blocking=run_blocking,
        )
        self.pull_handler = PullHandler(
            consumers=self.consumers,
            groups=groups,
            indexer=indexer,
            parked=self.parked,
            sweeper=self.sweeper,
            message_log=message_log,
            clock=clock,
            limits=limits,
            run_blocking=run_blocking,
        )
        self.retries = Retries(
            groups=groups,
            indexer=indexer,
            message_log=message_log,
            sender=self.send_handler,
            clock=clock,
            run_blocking=run_blocking,
        )
        self.ack_handler = AckHandler(
            consumers=self.consumers,
            groups=groups,
            retries=self.retries,
            parked=self.parked,
            sweeper=self.sweeper,
            commit=self.committer.commit,
            clock=clock,
            limits=limits,
        )
        indexer.on_indexed = self.parked.wake
        indexer.on_ids = dedup.indexed
        self.frame_server = FrameServer(
            {
                Command.SEND: self.send_handler.handle,
                Command.PULL: self.pull_handler.handle,
                Command.ACK: self.ack_handler.ack,
                Command.NACK: self.ack_handler.nack,
                Command.CONSUMER_HEARTBEAT: self.ack_handler.heartbeat,
                Command.STATUS: self._status,
            },
            limits=limits,
        )

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would.

        Every task is cancelled where it waits, the block's own code too
        (``open_realtime_server`` then returns quietly), and nothing more is
        committed: no last checkpoint. What was written stays, as the page cache
        keeps it for the next process.
        """
        self.crashed = True
        if self._life is not None:
            self._life.cancel()

    @property
    def scheduler_routes(self) -> RouteClient | None:
        """Where retries go: a scheduler of the ``delayed-producer`` route (set up with a meta_address)."""
        return self.retries.scheduler_routes

    @scheduler_routes.setter
    def scheduler_routes(self, routes: RouteClient | None) -> None:
        self.retries.scheduler_routes = routes

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> RealtimeStatistics:
        groups = self._groups
        sent, pulled, retries = self.send_handler, self.pull_handler, self.retries
        return RealtimeStatistics(
            address=self.address,
            group=self.group,
            sends=sent.sends,
            messages_stored=sent.stored,
            duplicates=sent.duplicates,
            pulls=pulled.pulls,
            pulls_waiting=self.parked.count,
            messages_delivered=pulled.delivered,
            acks=groups.acks,
            nacks=groups.nacks,
            redeliveries=groups.redelivered,
            retries_scheduled=retries.scheduled,
            retries_stored=retries.stored,
            dead_letters=retries.dead_letters,
            retries_given_back=retries.given_back,
            consumers=len(groups.live),
            subjects=len(self._indexer.logs),
            message_log_end=self._log.end_offset,
            indexed_offset=self._indexer.indexed_offset,
            dedup_ids_in_memory=len(self._dedup),
            checkpoints=self.committer.commits,
            checkpoint_failures=self.committer.failures,
            fenced=self.fences.refused,
            fence_raises=self.fences.raised,
        )

    async def _status(self, request: Request) -> dict[str, Any]:
        if request.metadata:
            key = next(iter(request.metadata))
            raise RemoteProtocolError(
                f"STATUS: unknown field {key!r} (STATUS takes none)", code="bad_request", field=key
            )
        return {
            "group": self.group,
            "address": self.address,
            "now_ms": self._clock.now_ms(),
            "fences": self.fences.table(),
            "statistics": asdict(self.statistics()),
        }

    # --------------------------------------------------------------- checkpoints

    def _take_snapshot(self) -> Snapshot:
        shares, consumers = self._groups.take_dirty()
        pull_logs = self.consumers.take_written()
        return Snapshot(
            index_offset=self._indexer.indexed_offset,
            consume=[(consume_log, consume_log.count) for consume_log in self._indexer.take_dirty()],
            pull_logs=pull_logs,
            dedup_ids=self._dedup.take_unpersisted(),
            shares=[(share, encode_share(share)) for share in shares],
            consumers=[(consumer, encode_consumer(consumer)) for consumer in consumers],
            now=self._clock.now_ms(),
        )

    def _write_snapshot(self, snapshot: Snapshot) -> None:
        write_snapshot(
            snapshot,
            store=self._store,
            message_log=self._log,
            consume_dir=self._consume_dir,
            pull_dir=self._pull_dir,
            dedup_buckets=self._dedup_buckets,
            window_ms=self._dedup.window_ms,
        )

    def _snapshot_done(self, snapshot: Snapshot) -> None:
        self._dedup.committed(snapshot.dedup_ids, self._clock.now_ms())
        self.consumers.forget_idle()

    def _snapshot_failed(self, snapshot: Snapshot) -> None:
        self._dedup.restore_unpersisted(snapshot.dedup_ids)
        self._groups.dirty_shares.update(share for share, _ in snapshot.shares)
        self._groups.dirty_consumers.update(consumer for consumer, _ in snapshot.consumers)
        self._indexer.dirty.update(consume_log for consume_log, _ in snapshot.consume)
        self.consumers.restore_written(snapshot.pull_logs)


# ------------------------------------------------------------------- opening


@asynccontextmanager
async def open_realtime_server(
    *,
    data_dir: str | Path,
    clock: Clock,
    listen: str = "127.0.0.1:0",
    group: str = "realtime-1",
    meta_address: str | Sequence[str] | None = None,
    advertise_address: str | None = None,
    flush: FlushPolicy = "sync",
    limits: Limits = DEFAULT_LIMITS,
    dedup_window_ms: int = 600_000,
    dedup_memory_ids: int = 100_000,
    ack_timeout_ms: int = 60_000,
    consumer_timeout_ms: int = 30_000,
    checkpoint_interval_ms: int = 1000,
    segment_size: int = DEFAULT_SEGMENT_SIZE,
    run_blocking: RunBlocking = run_in_thread,
) -> AsyncIterator[RealtimeServer]:
    """Open the data folder, catch up, serve on ``listen`` until the block ends.

    ``flush="sync"`` answers a SEND once its records are fsynced; ``"async"``
    once written (fsync every 100 ms: a crash may lose the last moments).
    ``meta_address`` (one or several) registers the server with a metaserver as
    ``advertise_address`` (default: the bound address, ``server.address``);
    ``server.registration`` then holds the metaserver's latest word.
    ``run_blocking`` runs the disk work (default: a worker thread; ``run_inline``
    for autojump tests).
    """
    check_max_record(limits.max_record)
    if checkpoint_interval_ms <= 0:
        raise ValueError(f"checkpoint_interval_ms must be positive, got {checkpoint_interval_ms}")
    bind = split_listen(listen)
    root = Path(data_dir)
    groups = Groups(ack_timeout_ms=ack_timeout_ms, consumer_timeout_ms=consumer_timeout_ms)
    start_ms = clock.now_ms()
    dedup = DedupWindow(window_ms=dedup_window_ms, memory_ids=dedup_memory_ids, covers_from=start_ms)

    indexer: Indexer | None = None  # known once recovered; closed with the storage (read at close time)
    async with open_blocking(
        partial(open_storage, root, segment_size=segment_size),
        lambda storage: storage.close(indexer),
        run_blocking=run_blocking,
    ) as storage:
        message_log = storage.message_log
        recovered, dedup_buckets, in_flight = await run_blocking(
            lambda: recover(
                message_log=message_log,
                store=storage.store,
                consume_dir=storage.consume_folder.path,
                pull_dir=storage.pull_folder.path,
                groups=groups,
                dedup=dedup,
                now=start_ms,
                found=storage.found,
            )
        )
        indexer = recovered
        fences = await run_blocking(partial(load_fences, storage.store))
        server = RealtimeServer(
            group=group,
            clock=clock,
            limits=limits,
            message_log=message_log,
            store=storage.store,
            indexer=recovered,
            dedup=dedup,
            groups=groups,
            pull_dir=storage.pull_folder.path,
            consume_dir=storage.consume_folder.path,
            dedup_buckets=dedup_buckets,
            fences=fences,
            run_blocking=run_blocking,
            checkpoint_interval_ms=checkpoint_interval_ms,
        )
        now = clock.monotonic_ms()  # the groups' timeouts are intervals: a wall-clock step must not fire them
        for consumer, pull_log in in_flight:
            server.consumers.adopt(consumer, pull_log, now)

        async def register(nursery: trio.Nursery, address: str) -> None:
            """Retries go to a scheduler the metaserver routes to; the server registers with it."""
            assert meta_address is not None
            server.scheduler_routes = RouteClient(
                Peers(nursery, limits=limits), meta_addresses(meta_address), clock=clock
            )
            server.registration = await start_registration(
                nursery,
                Peers(nursery),
                group=group,
                kind=ServerKind.REALTIME,
                address=address,
                meta_address=meta_address,
                clock=clock,
            )

        body_error: Exception | None = None
        async with open_log_writer(message_log, flush=flush, run_blocking=run_blocking) as writer:
            server.send_handler.writer = writer
            # The crash scope sits inside the writer: a SEND's shielded append still gets its answer.
            with trio.CancelScope() as life:
                server._life = life
                async with serve_frames(
                    server.frame_server,
                    bind=bind,
                    advertise_address=advertise_address,
                    tasks=[
                        server.committer.run,
                        server.sweeper.run,
                        partial(recovered.run, clock=clock),  # retries a stalled index step
                    ],
                    register=register if meta_address is not None else None,
                ) as address:
                    server.address = address
                    log.info("realtime server %s serving on %s (data %s)", group, server.address, root)
                    try:
                        yield server
                    except Exception as error:
                        body_error = error  # raised after the last checkpoint
        if not server.crashed:
            with trio.CancelScope(shield=True):
                await server.committer.commit_now()
        if body_error is not None:
            raise body_error


__all__ = ["RealtimeServer", "RealtimeStatistics", "open_realtime_server"]
