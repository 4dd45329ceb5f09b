"""The realtime server: SEND, PULL, ACK, NACK and CONSUMER_HEARTBEAT over the shared transport.

``open_realtime_server`` opens the data folder (``messages/`` the message log,
``consume/`` the consume logs, ``pull/`` the pull logs, ``state/`` lmdb; see
docs/realtime-storage.md), catches the consume logs up with the message log,
then serves until its block ends. Start-up and shutdown order follow the nesting:
the log writer outlives the handlers, and a last checkpoint is written after both.

Per request the work is one pass over a batch's headers (SEND), or one read of
consume-log entries and one read of the records (PULL, in a worker thread);
waiting pulls park on a per-subject ``ParkingLot`` and cost nothing until an
entry for their subject is indexed or given back.

A NACK with ``delay_ms`` re-schedules its messages: they are re-addressed to the
group's retry subject ``%retry%<group>%<subject>`` (same id, ``attempts`` + 1,
``deliver_at`` = now + delay) and handed to a scheduler (route
``delayed-producer``, through the metaserver of ``meta_address``), which delivers
them back to a realtime group when due. A NACK with ``dead`` appends them to this
server's own log as ``%dead%<group>%<subject>`` at once (and so does a delay of
0, as a retry). The range counts as settled only once the scheduler (or the log)
took them; with no scheduler to take them they go back to the group at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

import trio

from delaymq.client.producer import DELAYED_ROUTE, meta_addresses
from delaymq.client.retry import dead_subject, retry_subject
from delaymq.client.routes import RouteClient, RouteError
from delaymq.metaserver.agent import Registration, run_registration
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import ProtocolError, RemoteProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.records import MessageBatch, decode_batch, encode_message, scan_batch, tags_mask
from delaymq.protocol.transport import FrameServer, Peers, Request, TransportError
from delaymq.realtime import dedup as dedup_store
from delaymq.realtime.checkpoint import (
    Committer,
    Snapshot,
    consumer_from_record,
    encode_consumer,
    encode_share,
    load_consumer,
    share_key,
    write_snapshot,
)
from delaymq.realtime.consumelog import CONSUME_FORMAT
from delaymq.realtime.dedup import DedupWindow, dedup_keys
from delaymq.realtime.delivery import Picked, pick, read_records
from delaymq.realtime.groups import Claim, ConsumerState, Groups, Share
from delaymq.realtime.index import REPLAY_LIMITS, Indexer, Item
from delaymq.realtime.pulllog import PULL_FORMAT, PullLog, consumer_stem, encode_pull_entries
from delaymq.realtime.recovery import open_folder, recover
from delaymq.realtime.requests import AckRequest, PullRequest, parse_ack, parse_heartbeat, parse_pull
from delaymq.storage.folder import DataFolder
from delaymq.storage.log import DEFAULT_MAX_RECORD, DEFAULT_SEGMENT_SIZE, SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.storage.writer import FlushPolicy, LogWriter, open_log_writer
from delaymq.wheel.clock import Clock

log = logging.getLogger(__name__)

#: How long a NACK may wait for a scheduler to take its retries (all attempts),
#: and one attempt; past it the messages go back to the group at once.
SCHEDULE_DEADLINE_S = 8.0
SCHEDULE_TIMEOUT_S = 4.0
_MAX_ATTEMPTS = 0xFFFF


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
        checkpoint_interval_ms: int = 1000,
    ) -> None:
        self.group = group
        self.address = ""
        self.registration: Registration | None = None
        self._clock = clock
        self._limits = limits
        self._log = message_log
        self._store = store
        self._indexer = indexer
        self._dedup = dedup
        self._groups = groups
        self._pull_dir = pull_dir
        self._consume_dir = consume_dir
        self._dedup_buckets = dedup_buckets
        self._writer: LogWriter | None = None
        self._pull_logs: dict[bytes, PullLog] = {}
        self._pull_written: set[PullLog] = set()
        self._loading: dict[bytes, trio.Event] = {}
        self._lots: dict[str, trio.lowlevel.ParkingLot] = {}
        self._sweep_wakeup = trio.Event()
        self._sweep_scope: trio.CancelScope | None = None
        self._sweeping_for = math.inf  # the deadline the sweeper sleeps for
        self._sweep_step = max(1, min(groups.ack_timeout_ms, groups.consumer_timeout_ms) // 20)
        #: Where retries go: a scheduler of the ``delayed-producer`` route (set up with a meta_address).
        self.scheduler_routes: RouteClient | None = None
        self._retries_scheduled = 0
        self._retries_stored = 0
        self._dead_letters = 0
        self._retries_given_back = 0
        indexer.on_indexed = self._wake_subjects
        indexer.on_ids = dedup.indexed
        self.committer = Committer(
            take=self._take_snapshot,
            write=self._write_snapshot,
            done=self._snapshot_done,
            failed=self._snapshot_failed,
            interval_ms=checkpoint_interval_ms,
        )
        self.frame_server = FrameServer(
            {
                Command.SEND: self._send,
                Command.PULL: self._pull,
                Command.ACK: self._ack,
                Command.NACK: self._nack,
                Command.CONSUMER_HEARTBEAT: self._heartbeat,
            },
            limits=limits,
        )
        self._sends = 0
        self._stored = 0
        self._duplicates = 0
        self._pulls = 0
        self._waiting = 0
        self._delivered = 0

    # --------------------------------------------------------------- public

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> RealtimeStatistics:
        groups = self._groups
        return RealtimeStatistics(
            address=self.address,
            group=self.group,
            sends=self._sends,
            messages_stored=self._stored,
            duplicates=self._duplicates,
            pulls=self._pulls,
            pulls_waiting=self._waiting,
            messages_delivered=self._delivered,
            acks=groups.acks,
            nacks=groups.nacks,
            redeliveries=groups.redelivered,
            retries_scheduled=self._retries_scheduled,
            retries_stored=self._retries_stored,
            dead_letters=self._dead_letters,
            retries_given_back=self._retries_given_back,
            consumers=len(groups.live),
            subjects=len(self._indexer.logs),
            message_log_end=self._log.end_offset,
            indexed_offset=self._indexer.indexed_offset,
            dedup_ids_in_memory=len(self._dedup),
            checkpoints=self.committer.commits,
            checkpoint_failures=self.committer.failures,
        )

    # --------------------------------------------------------------- SEND

    async def _send(self, request: Request) -> dict[str, Any]:
        if request.metadata:
            key = next(iter(request.metadata))
            raise RemoteProtocolError(
                f"SEND: unknown field {key!r} (SEND takes no metadata; the batch is the body)",
                code="bad_request",
                field=key,
            )
        body = request.body
        if not body:
            raise RemoteProtocolError("SEND: the body holds no records", code="bad_request", field="body")
        fresh = await self._append_batch(scan_batch(body, self._limits))
        self._sends += 1
        return {"results": ["stored" if new else "duplicate" for new in fresh]}

    async def _append_batch(self, batch: MessageBatch) -> list[bool]:
        """Append a checked batch's new records (dedup) and index them; which records were new."""
        ids = dedup_keys(batch)
        dedup = self._dedup
        now = self._clock.now_ms()
        unsure = dedup.to_look_up(ids, now)
        stored: set[str] = set()
        if unsure:
            stored = await trio.to_thread.run_sync(
                dedup_store.lookup_stored, self._store, unsure, now - dedup.window_ms
            )
            now = self._clock.now_ms()
        fresh = dedup.admit(ids, now, stored)
        kept = [index for index, new in enumerate(fresh) if new]
        self._duplicates += len(ids) - len(kept)
        if not kept:
            return fresh
        starts, ends = batch.starts, batch.ends
        if len(kept) == len(ids):
            data = batch.buf
        else:
            data = b"".join([batch.buf[starts[i] : ends[i]] for i in kept])
        kept_ids = [ids[i] for i in kept]
        assert self._writer is not None
        try:
            # Shielded: once handed to the writer the batch may reach the log, and
            # then it must be indexed (the index moves in offset order only).
            with trio.CancelScope(shield=True):
                base = await self._writer.append(data)
        except BaseException:
            dedup.forget(kept_ids)
            raise
        items: list[Item] = []
        offset = base
        subjects, tags = batch.subjects, batch.tags
        for i in kept:
            size = ends[i] - starts[i]
            record_tags = tags[i]
            items.append((subjects[i], offset, size, tags_mask(record_tags) if record_tags else 0))
            offset += size
        self._indexer.submit(base, offset, items, kept_ids, self._clock.now_ms())
        self._stored += len(kept)
        return fresh

    # --------------------------------------------------------------- consumers

    async def _consumer(
        self, subject: str, group: str, consumer: str, *, create: PullRequest | None = None
    ) -> ConsumerState | None:
        """The consumer's state: in memory, loaded from lmdb, or (for a PULL) new."""
        key = bytes.fromhex(consumer_stem(subject, group, consumer))
        while True:
            state = self._groups.consumers.get(key)
            if state is not None:
                break
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()
        if state is None:
            loading = self._loading[key] = trio.Event()
            try:
                state = await self._load_consumer(key, subject, group, consumer, create)
            finally:
                del self._loading[key]
                loading.set()
        if state is not None and create is not None and state.broadcast != create.broadcast:
            mode = "broadcast" if state.broadcast else "clustered"
            raise RemoteProtocolError(
                f"PULL: consumer {consumer!r} of group {group!r} reads subject {subject!r} as "
                f"{mode}; broadcast is {create.broadcast} here",
                code="bad_value",
                field="broadcast",
            )
        return state

    async def _load_consumer(
        self, key: bytes, subject: str, group: str, name: str, create: PullRequest | None
    ) -> ConsumerState | None:
        pull_log = PullLog(self._pull_dir, key.hex())

        def load() -> tuple[dict[str, Any] | None, tuple[list[int], list[int]]]:
            record = load_consumer(self._store, key)
            if record is None:
                if create is not None:
                    pull_log.truncate(0)  # left by a run that crashed before committing it
                return None, ([], [])
            pull_log.truncate(record["length"])
            return record, pull_log.read(record["acked"], record["length"])

        record, (sequences, redeliveries) = await trio.to_thread.run_sync(load)
        now = self._clock.now_ms()
        if record is None and create is None:
            return None
        broadcast = record["broadcast"] if record is not None else create.broadcast  # type: ignore[union-attr]
        share = self._share(subject, group, name if broadcast else None, earliest=bool(create and create.earliest))
        if record is not None:
            state = consumer_from_record(key, record, share, sequences, redeliveries)
        else:
            state = ConsumerState(key, subject, group, name, share)
            pull_log.create(subject, group, name)
            self._pull_written.add(pull_log)
            self._groups.dirty_consumers.add(state)
        self._pull_logs[key] = pull_log
        self._groups.add_consumer(state, now)
        self._poke_sweeper(now)
        return state

    def _share(self, subject: str, group: str, broadcast_consumer: str | None, *, earliest: bool) -> Share:
        key = share_key(subject, group, broadcast_consumer)
        share = self._groups.shares.get(key)
        if share is None:
            position = 0 if earliest else self._indexer.count(subject)
            share = self._groups.add_share(Share(key, subject, group, broadcast_consumer, position))
            self._groups.dirty_shares.add(share)
        return share

    # --------------------------------------------------------------- PULL

    async def _pull(self, request: Request) -> tuple[dict[str, Any], bytes]:
        pull = parse_pull(request.metadata, self._limits)
        consumer = await self._consumer(pull.subject, pull.group, pull.consumer, create=pull)
        assert consumer is not None
        groups = self._groups
        now = self._clock.now_ms()
        groups.touch(consumer, now)
        self._poke_sweeper(now)
        mask = tags_mask(pull.tags) if pull.tags else 0
        deadline = trio.current_time() + pull.timeout_ms / 1000
        subject = pull.subject
        consumer.waiting += 1  # a consumer in a long poll is alive
        try:
            while True:
                picked, more = pick(
                    self._indexer.consume_log(subject), groups, consumer.share, pull.max, pull.max_bytes, mask
                )
                if picked or trio.current_time() >= deadline:
                    break
                if more:
                    await trio.lowlevel.checkpoint()
                    continue
                lot = self._lots.get(subject)
                if lot is None:
                    lot = self._lots[subject] = trio.lowlevel.ParkingLot()
                self._waiting += 1
                try:
                    with trio.move_on_at(deadline):
                        await lot.park()
                finally:
                    self._waiting -= 1
                    if not lot and self._lots.get(subject) is lot:
                        del self._lots[subject]
        finally:
            consumer.waiting -= 1
        self._pulls += 1
        now = self._clock.now_ms()
        if not picked:
            groups.touch(consumer, now)
            return {"pull_start": consumer.length, "count": 0, "acked": consumer.acked}, b""
        sequences = [item[0] for item in picked]
        redeliveries = [item[1] for item in picked]
        start = groups.record_pull(consumer, sequences, redeliveries, now)
        pull_log = self._pull_logs[consumer.key]
        pull_log.write(start, encode_pull_entries(sequences, redeliveries))
        self._pull_written.add(pull_log)
        self._poke_sweeper(now)
        self._delivered += len(picked)
        body = await trio.to_thread.run_sync(read_records, self._log, picked)
        return {"pull_start": start, "count": len(picked), "acked": consumer.acked}, body

    # --------------------------------------------------------------- ACK, NACK, heartbeat

    async def _ack(self, request: Request) -> dict[str, Any]:
        ack = parse_ack(request.metadata, self._limits)
        consumer = await self._consumer(ack.subject, ack.group, ack.consumer)
        names = f"consumer {ack.consumer!r} of group {ack.group!r} on subject {ack.subject!r}"
        acked = self._groups.ack(consumer, ack.start, ack.end, names)
        assert consumer is not None
        now = self._clock.now_ms()
        self._groups.touch(consumer, now)
        self._poke_sweeper(now)
        await self._commit()
        return {"acked": acked}

    async def _nack(self, request: Request) -> dict[str, Any]:
        nack = parse_ack(request.metadata, self._limits, nack=True)
        consumer = await self._consumer(nack.subject, nack.group, nack.consumer)
        names = f"consumer {nack.consumer!r} of group {nack.group!r} on subject {nack.subject!r}"
        now = self._clock.now_ms()
        if not nack.retry or consumer is None or consumer.broadcast:
            # Back to the group at once: asked so, or a broadcast consumer (its own
            # read position: a retry subject would reach every consumer of its group).
            acked, shares = self._groups.nack(consumer, nack.start, nack.end, now, names)
        else:
            claim = self._groups.claim(consumer, nack.start, nack.end, now, names)
            shares = []
            if claim is not None:
                # Shielded (and bounded): a claim must end, whether the consumer
                # hangs up or not, or its messages would be held back for good.
                with trio.CancelScope(shield=True):
                    shares = await self._retry(claim, nack)
            acked = consumer.acked
        now = self._clock.now_ms()
        self._poke_sweeper(now)
        for share in shares:
            self._wake(share.subject)
        await self._commit()
        return {"acked": acked}

    async def _retry(self, claim: Claim, nack: AckRequest) -> list[Share]:
        """Re-address a claim's messages and place them (scheduler or log); ends the claim."""
        done = False
        count = len(claim.entries)
        try:
            records = await self._read_claimed(claim)
            now = self._clock.now_ms()
            if nack.dead:
                subject, deliver_at = dead_subject(nack.group, nack.subject), now
            else:
                assert nack.delay_ms is not None
                subject, deliver_at = retry_subject(nack.group, nack.subject), now + nack.delay_ms
            body = readdress(records, subject=subject, deliver_at=deliver_at)
            if nack.dead or deliver_at <= now:
                await self._append_batch(scan_batch(body, REPLAY_LIMITS))
                done = True
                if nack.dead:
                    self._dead_letters += count
                    log.info("realtime: %d message(s) of group %s to %s after their last attempt",
                             count, nack.group, subject)  # fmt: skip
                else:
                    self._retries_stored += count
            else:
                done = await self._schedule(body, count, subject)
                if done:
                    self._retries_scheduled += count
                else:
                    self._retries_given_back += count
        finally:
            shares = self._groups.release(claim, done=done)
        return shares

    async def _read_claimed(self, claim: Claim) -> bytes:
        """The claimed records as their consumer got them (``attempts`` with redeliveries)."""
        consume_log = self._indexer.consume_log(claim.consumer.subject)
        assert consume_log is not None  # the consumer was handed entries of it
        picked: list[Picked] = []
        for sequence, redeliveries in claim.entries:
            entry = consume_log.entry(sequence)
            picked.append((sequence, redeliveries, entry.offset, entry.size))
        return await trio.to_thread.run_sync(read_records, self._log, picked)

    async def _schedule(self, body: bytes, count: int, subject: str) -> bool:
        """Hand retries to a scheduler; False (logged) when none took them."""
        routes = self.scheduler_routes
        if routes is None:
            log.warning("realtime: no scheduler (no meta_address) for %d retr%s on %s; given back at once",
                        count, "y" if count == 1 else "ies", subject)  # fmt: skip
            return False
        try:
            with trio.fail_after(SCHEDULE_DEADLINE_S):
                frame = await routes.call(
                    DELAYED_ROUTE, Command.SCHEDULE, {}, body, attempts=3, timeout=SCHEDULE_TIMEOUT_S
                )
        except (RouteError, ProtocolError, TransportError, trio.TooSlowError) as error:
            log.warning("realtime: no scheduler took %d retr%s on %s (%s); given back at once",
                        count, "y" if count == 1 else "ies", subject, str(error) or type(error).__name__)  # fmt: skip
            return False
        results = frame.metadata.get("results")
        if not isinstance(results, list) or len(results) != count:
            log.warning("realtime: scheduler answered SCHEDULE of %d retries with results %r; given back at once",
                        count, results)  # fmt: skip
            return False
        return True  # "scheduled", or "duplicate": it holds them already

    async def _heartbeat(self, request: Request) -> dict[str, Any]:
        beat = parse_heartbeat(request.metadata, self._limits)
        now = self._clock.now_ms()
        consumers = self._groups.consumers
        for subject in beat.subjects:
            state = consumers.get(bytes.fromhex(consumer_stem(subject, beat.group, beat.consumer)))
            if state is not None:
                self._groups.touch(state, now)
        self._poke_sweeper(now)
        return {}

    async def _commit(self) -> None:
        try:
            await self.committer.commit()
        except Exception as error:
            raise RemoteProtocolError(
                f"the server could not make the change durable ({type(error).__name__}: {error}); "
                "it is applied in memory and will be retried",
                code="unavailable",
            ) from error

    # --------------------------------------------------------------- waking

    def _wake(self, subject: str) -> None:
        lot = self._lots.get(subject)
        if lot is not None:
            lot.unpark_all()

    def _wake_subjects(self, subjects: set[str]) -> None:
        lots = self._lots
        for subject in subjects:
            lot = lots.get(subject)
            if lot is not None:
                lot.unpark_all()

    # --------------------------------------------------------------- redelivery

    def _poke_sweeper(self, now: int) -> None:
        """A deadline may now be earlier than the one the sweeper sleeps to."""
        if self._sweep_scope is None:
            self._sweep_wakeup.set()
            return
        deadline = self._groups.next_deadline()
        if deadline is not None and deadline < self._sweeping_for:
            self._sweep_scope.cancel()

    async def _sweep_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Give back what timed out, at the earliest deadline (at most every ``_sweep_step`` ms)."""
        task_status.started()
        last = -math.inf
        groups = self._groups
        while True:
            deadline = groups.next_deadline()
            if deadline is None:
                self._sweep_wakeup = trio.Event()
                await self._sweep_wakeup.wait()
                continue
            target = int(max(deadline, last + self._sweep_step))
            with trio.CancelScope() as scope:
                self._sweep_scope = scope
                self._sweeping_for = deadline
                await self._clock.sleep_until_ms(target)
            self._sweep_scope = None
            self._sweeping_for = math.inf
            if scope.cancelled_caught:
                continue
            now = self._clock.now_ms()
            last = now
            for share in groups.expire(now):
                self._wake(share.subject)

    # --------------------------------------------------------------- checkpoints

    def _take_snapshot(self) -> Snapshot:
        shares, consumers = self._groups.take_dirty()
        pull_logs = list(self._pull_written)
        self._pull_written.clear()
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
        for key in self._groups.forget_idle():
            self._pull_logs.pop(key, None)

    def _snapshot_failed(self, snapshot: Snapshot) -> None:
        self._dedup.restore_unpersisted(snapshot.dedup_ids)
        self._groups.dirty_shares.update(share for share, _ in snapshot.shares)
        self._groups.dirty_consumers.update(consumer for consumer, _ in snapshot.consumers)
        self._indexer.dirty.update(consume_log for consume_log, _ in snapshot.consume)
        self._pull_written.update(snapshot.pull_logs)


def readdress(records: bytes, *, subject: str, deliver_at: int) -> bytes:
    """The records again, sent to ``subject`` at ``deliver_at`` with ``attempts`` + 1; ids kept."""
    out = []
    for message in decode_batch(records, REPLAY_LIMITS):
        out.append(
            encode_message(
                message.id,
                subject,
                tags=message.tags,
                properties=message.properties or None,
                body=message.body,
                deliver_at=deliver_at,
                created_at=message.created_at,
                attempts=min(message.attempts + 1, _MAX_ATTEMPTS),
                limits=REPLAY_LIMITS,
            )
        )
    return b"".join(out)


# ------------------------------------------------------------------- opening


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen {listen!r} is not HOST:PORT with a port from 0 to 65535")
    return host, int(port)


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
) -> AsyncIterator[RealtimeServer]:
    """Open the data folder, catch up, serve on ``listen`` until the block ends.

    ``flush="sync"`` answers a SEND once its records are fsynced; ``"async"``
    once written (fsync every 100 ms: a crash may lose the last moments).
    ``meta_address`` (one or several) registers the server with a metaserver as
    ``advertise_address`` (default: the bound address, ``server.address``);
    ``server.registration`` then holds the metaserver's latest word.
    """
    if limits.max_record > DEFAULT_MAX_RECORD:
        raise ValueError(
            f"limits allow records of {limits.max_record} bytes; the message log holds at most "
            f"{DEFAULT_MAX_RECORD}"
        )
    if checkpoint_interval_ms <= 0:
        raise ValueError(f"checkpoint_interval_ms must be positive, got {checkpoint_interval_ms}")
    host, port = _split_listen(listen)
    root = Path(data_dir)
    groups = Groups(ack_timeout_ms=ack_timeout_ms, consumer_timeout_ms=consumer_timeout_ms)
    start_ms = clock.now_ms()
    dedup = DedupWindow(window_ms=dedup_window_ms, memory_ids=dedup_memory_ids, covers_from=start_ms)

    def open_storage() -> tuple[SegmentedLog, StateStore, DataFolder, DataFolder]:
        root.mkdir(parents=True, exist_ok=True)
        opened: list[Any] = []
        try:
            opened.append(SegmentedLog.open(root / "messages", segment_size=segment_size))
            opened.append(StateStore.open(root / "state", extra_format={"realtime_state": 1}))
            opened.append(open_folder(root / "consume", "consume logs", dict(CONSUME_FORMAT)))
            opened.append(open_folder(root / "pull", "pull logs", dict(PULL_FORMAT)))
        except BaseException:
            for thing in reversed(opened):
                thing.close()
            raise
        return opened[0], opened[1], opened[2], opened[3]

    message_log, store, consume_folder, pull_folder = await trio.to_thread.run_sync(open_storage)
    indexer: Indexer | None = None
    try:
        indexer, dedup_buckets, in_flight = await trio.to_thread.run_sync(
            lambda: recover(
                message_log=message_log,
                store=store,
                consume_dir=consume_folder.path,
                pull_dir=pull_folder.path,
                groups=groups,
                dedup=dedup,
                now=start_ms,
            )
        )
        server = RealtimeServer(
            group=group,
            clock=clock,
            limits=limits,
            message_log=message_log,
            store=store,
            indexer=indexer,
            dedup=dedup,
            groups=groups,
            pull_dir=pull_folder.path,
            consume_dir=consume_folder.path,
            dedup_buckets=dedup_buckets,
            checkpoint_interval_ms=checkpoint_interval_ms,
        )
        now = clock.now_ms()
        for consumer, pull_log in in_flight:
            server._pull_logs[consumer.key] = pull_log
            groups.add_consumer(consumer, now)
        body_error: Exception | None = None
        async with open_log_writer(message_log, flush=flush) as writer:
            server._writer = writer
            async with trio.open_nursery() as nursery:
                await nursery.start(server.committer.run)
                await nursery.start(server._sweep_loop)
                server.address = await nursery.start(server.frame_server.serve, host, port)
                if meta_address is not None:
                    server.scheduler_routes = RouteClient(
                        Peers(nursery, limits=limits), meta_addresses(meta_address), clock=clock
                    )
                    server.registration = await _start_registration(
                        nursery, server, meta_address, advertise_address or server.address, clock
                    )
                log.info("realtime server %s serving on %s (data %s)", group, server.address, root)
                try:
                    yield server
                except Exception as error:
                    body_error = error  # raised below, not inside an ExceptionGroup
                finally:
                    nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True):
            await server.committer.commit_now()
        if body_error is not None:
            raise body_error
    finally:
        with trio.CancelScope(shield=True):

            def close() -> None:
                try:
                    if indexer is not None:
                        indexer.close()
                finally:
                    try:
                        message_log.close()
                    finally:
                        store.close()
                        consume_folder.close()
                        pull_folder.close()

            await trio.to_thread.run_sync(close)


def _software_version() -> str:
    try:
        return metadata.version("delaymq")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


async def _start_registration(
    nursery: trio.Nursery, server: RealtimeServer, meta_address: str | Sequence[str], address: str, clock: Clock
) -> Registration:
    """Register with the metaserver and keep heartbeating (``delaymq.metaserver.agent``).

    Returns after the first attempt, answered or not: a metaserver that is down
    does not keep the server from starting; one that refuses it does.
    """
    info = {
        "group": server.group,
        "kind": "realtime",
        "role": "master",
        "address": address,
        "version": _software_version(),
    }
    registration: Registration = await nursery.start(
        partial(run_registration, Peers(nursery), meta_address=meta_address, info=info, clock=clock)
    )
    return registration


__all__ = ["RealtimeServer", "RealtimeStatistics", "open_realtime_server", "readdress"]
