"""The scheduler (delay server): SCHEDULE, FETCH and STATUS over the shared transport.

``open_scheduler`` opens the data folder (``messages/`` the write-ahead message log,
``state/`` lmdb, ``schedule/`` the hourly schedule logs; docs/scheduler-storage.md)
and runs one member of a scheduler group until its block ends. The metaserver says
whether the member is master or slave (``delaymq.scheduler.roles``: a slave fetches
the master's log and files it, a promoted one takes over; docs/replication.md); a
scheduler without a metaserver is master for good. As master:

- **SCHEDULE** checks every record (``scan_batch`` with the horizon), sets a past
  ``deliver_at`` to the time of receipt (a message is never filed into an hour before
  the current one: ``delaymq.wheel.tick``), appends the batch to the message log and
  answers once the append is durable under the flush policy and, under sync
  replication, held by ``min_insync`` in-sync slaves; then wakes replay.
- **replay** files the message log into the schedule logs (``replay_step`` in a
  thread, until caught up) and tells the dispatcher of every entry filed.
- the **dispatcher** (``delaymq.scheduler.dispatcher``) fires each message at its
  millisecond and hands it to a realtime server.
- **cleanup** (every ``cleanup_interval_ms``) deletes message-log segments below the
  replay checkpoint and hours fully delivered longer than ``retention_ms`` ago; a
  master rolls its active segment first if it holds filed records, so the message log
  holds little more than what is not yet filed. Between rounds, while the server is
  busy, segments are deleted as soon as they are filed and the counters (totals since
  the folder was created) are saved in lmdb, at most once a second.
- **STATUS** reports the tick, the pending count of the next hours, what is not yet
  filed (bytes and records), the counters.

On start every hour not fully dispatched is loaded again, whatever its age, and the
dispatch logs say what to skip; overdue messages go out at once, oldest first.
Shutdown writes nothing the server would not also have written had it been killed
(``crash`` is the test hook for a kill). Docs: docs/scheduler.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from delaymq.client.registration import Registration, start_registration
from delaymq.client.routes import CLIENT_PEERS_OPTIONS, NoRouteError, RouteClient
from delaymq.clock import Alarm, Clock
from delaymq.net.addresses import split_listen
from delaymq.net.auth import require_server
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.peers import AsyncCaller, open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.serving import Task, serve_frames
from delaymq.protocol.cancel import MAX_KEY
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError, RemoteProtocolError
from delaymq.protocol.fencing import FENCED, Fence
from delaymq.protocol.records import rewrite_delivery, scan_batch
from delaymq.protocol.routes import ServerKind
from delaymq.replication.membership import member_identity
from delaymq.replication.roles import Mastership, NotMaster, RoleLoop
from delaymq.replication.wire import FetchRequest
from delaymq.scheduler.cancels import (
    Found,
    RecentDispatches,
    ScheduledBatch,
    TailEntry,
    fresh_records,
    look_up_fresh,
)
from delaymq.scheduler.changes import ChangeCommands
from delaymq.scheduler.cutback import cut_schedule_folder, lower_checkpoint
from delaymq.scheduler.dispatcher import (
    DEFAULT_DISPATCH_BATCH,
    DEFAULT_SEND_AHEAD_MS,
    DEFAULT_SEND_INTERVAL_MS,
    MAX_SEND_AHEAD_MS,
    Deliver,
    Dispatcher,
)
from delaymq.scheduler.hours import DEFAULT_RETENTION_MS, MAX_DELIVER_AT, ScheduleError, hour_name
from delaymq.scheduler.idcutback import drop_from
from delaymq.scheduler.idindex import (
    KEY_FIELDS,
    KEY_FIELDS_AT,
    record_key,
)
from delaymq.scheduler.replay import DEFAULT_STEP_BYTES, REPLAY_RECENT_BYTES, Unfiled, unfiled
from delaymq.scheduler.replica import DispatchRecords
from delaymq.scheduler.roles import MasterSession, Member, SlaveSession
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.status import (
    COUNTERS_DB,
    COUNTERS_KEY,
    SchedulerCounters,
    SchedulerStatistics,
    parse_status_request,
    status_answer,
)
from delaymq.scheduler.wheelset import DEFAULT_HOUR_PRELOAD_MS, DEFAULT_LOAD_AHEAD_MS, DEFAULT_MAX_LOADED, WheelSet
from delaymq.storage.errors import StorageError, storage_refusal
from delaymq.storage.format import read_format, write_format
from delaymq.storage.log import SegmentedLog, check_max_record
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.storage.writer import FlushPolicy, LogWriter, open_log_writer

if TYPE_CHECKING:
    from delaymq.client.registration import MembershipView

log = logging.getLogger(__name__)

DELIVERY_ROUTE = "scheduler-delivery"
DEFAULT_CLEANUP_INTERVAL_MS = 60_000
#: The write-ahead message log's segment size: filed segments are deleted whole, so the
#: bytes of the active segment are what the log may hold after filing (docs/scheduler-storage.md).
SCHEDULER_SEGMENT_SIZE = 64 << 20
#: While counters change they are saved at most this often (one small lmdb transaction).
COUNTERS_SAVE_MS = 1_000
#: How long a SCHEDULE waits for ``min_insync`` slaves under sync replication.
DEFAULT_REPLICATION_TIMEOUT_MS = 5_000
#: A SCHEDULE waits while replay is more than this far behind (``Scheduler._filing_room``):
#: under the bytes the message log keeps in memory, so replay files from there.
DEFAULT_MAX_UNFILED_BYTES = REPLAY_RECENT_BYTES * 3 // 4
#: ... and is refused ``unavailable`` (the client retries) after waiting this long.
FILING_WAIT_MS = 5_000


class MessageLog(SegmentedLog):
    """The scheduler's write-ahead log: a ``SegmentedLog`` whose active segment can be
    closed early (``roll``), so that filed records of a load too small to fill a segment
    can be deleted too (a segment goes only whole, and never the active one)."""

    def roll(self) -> bool:
        """Start a new segment at the end now (the active one is fsynced first, as a roll
        by size does); False if the active segment is empty. Blocking."""
        with self._append_lock:
            self._check_usable()
            if not self._active.size:
                return False
            self._roll()
            return True


class Scheduler(ChangeCommands):
    """One scheduler member. Build it with ``open_scheduler``."""

    def __init__(
        self,
        *,
        member: Member,
        stores: dict[str, ScheduleStore] | None = None,
        limits: Limits,
        retention_ms: int,
        cleanup_interval_ms: int,
        replication_timeout_ms: int,
        make_wheels: Callable[[list[int]], WheelSet],
        make_dispatcher: Callable[[WheelSet, Deliver, Callable[[dict[int, list[int]]], None]], Dispatcher],
        deliver: Callable[[int, Mastership], Deliver],
        counters: SchedulerCounters | None = None,
        max_unfiled_bytes: int = DEFAULT_MAX_UNFILED_BYTES,
    ) -> None:
        self.member = member
        self._max_unfiled_bytes = max_unfiled_bytes
        self._schedule_waits = 0  # SCHEDULEs that waited for filing (``_filing_room``)
        self.group = member.group
        self._stores = stores if stores is not None else {}
        self.registration: Registration | None = None
        self._clock = member.clock
        self._limits = limits
        self._log = member.log
        self._run_blocking = member.run_blocking
        self._retention_ms = retention_ms
        self._cleanup_interval_ms = cleanup_interval_ms
        self._replication_timeout_ms = replication_timeout_ms
        self._make_wheels = make_wheels
        self._make_dispatcher = make_dispatcher
        self._deliver = deliver
        self._writer: LogWriter | None = None
        self._life: trio.CancelScope | None = None
        self.roles: RoleLoop[MasterSession | SlaveSession] = RoleLoop(
            session_for=self._session_for,
            standalone=lambda: self._master_session(0),
            between=self._between_sessions,
        )
        self._idle_wheels = make_wheels([])
        self._idle_dispatcher = make_dispatcher(self._idle_wheels, _no_delivery, lambda rounds: None)
        self._fenced_epoch: int | None = None
        self.frame_server = FrameServer(
            {
                Command.SCHEDULE: self._schedule,
                Command.STATUS: self._status,
                Command.FETCH: self._fetch,
                Command.CANCEL: self._cancel,
                Command.MOVE: self._move,
                Command.QUERY: self._query,
            },
            limits=limits,
        )
        self.crashed = False
        #: Totals saved in lmdb when this process started; ``counters()`` adds this process's.
        self._counted_before = counters or SchedulerCounters()
        self._saved_counters = self._counted_before  # what lmdb holds now
        self._ended_sessions = SchedulerCounters()  # dispatch counts of ended master sessions
        self._filed_by_closed_stores = 0  # a cut-back reopens the store, whose count starts again
        self._counters_failing = False
        #: Wakes the housekeeping task (cleanup, filed segments, counters) when it sleeps idle.
        self._housekeeping = Alarm(self._clock)
        self._housekeeping_idle = False
        self._requests = 0
        self._scheduled = 0
        self._rewritten = 0
        self._deleted_hours = 0
        self._deleted_segments = 0
        self._cut_records = 0
        self._cut_bytes = 0
        self.duplicates = 0  # SCHEDULE records answered "duplicate"
        #: When realtime accepted the latest dispatches (QUERY's and CANCEL's ``dispatched_at``).
        self.recent = RecentDispatches()

    # --------------------------------------------------------------- public

    @property
    def address(self) -> str:
        return self.member.address

    @property
    def store(self) -> ScheduleStore:
        return self.member.store

    @property
    def role(self) -> str:
        """ "master", "slave", or "waiting" (for the metaserver's word, or after being fenced)."""
        if isinstance(self.session, MasterSession):
            return "master"
        if isinstance(self.session, SlaveSession):
            return "slave"
        return "waiting"

    @property
    def epoch(self) -> int:
        return self.session.epoch if self.session is not None else 0

    @property
    def wheels(self) -> WheelSet:
        return self.session.wheels if isinstance(self.session, MasterSession) else self._idle_wheels

    @property
    def dispatcher(self) -> Dispatcher:
        session = self.session
        if isinstance(session, MasterSession) and session.dispatcher is not None:
            return session.dispatcher
        return self._idle_dispatcher

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> SchedulerStatistics:
        """A snapshot; ``unfiled_records`` is -1 (counting reads the log: ``unfiled()``, STATUS)."""
        dispatch = self.dispatcher.statistics()
        totals = self._totals(dispatch.dispatched, dispatch.batches, dispatch.failures)
        segments = self._log.segments()
        counts = self.wheels.counts()
        session = self.session
        master = session if isinstance(session, MasterSession) else None
        slave = session if isinstance(session, SlaveSession) else None
        now = self._clock.now_ms()
        tick = self.wheels.tick(now)
        if slave is not None and slave.held_tick is not None:
            tick = slave.held_tick.tick
        return SchedulerStatistics(
            address=self.address,
            group=self.group,
            role=self.role,
            epoch=self.epoch,
            master=self.registration.master if self.registration is not None else self.address,
            replication=self._replication_statistics(master, slave, totals),
            schedule_requests=totals.schedule_requests,
            scheduled=totals.scheduled,
            rewritten=totals.rewritten,
            message_log_end=self._log.end_offset,
            checkpoint=self.store.checkpoint,
            filed=totals.filed,
            unfiled_bytes=max(0, self._log.end_offset - self.store.checkpoint),
            unfiled_records=-1,
            unfiled_exact=False,
            message_log_bytes=sum(size for _base, size in segments),
            message_log_segments=len(segments),
            pending=(master.pending + master.filed - master.cancelled - dispatch.recorded)
            if master is not None
            else -1,
            hours=counts.hours,
            open_hours=counts.open_hours,
            loaded=counts.scheduled + counts.in_flight,
            buffered=counts.buffered,
            cached_records=dispatch.cached_records,
            delivered_held=dispatch.delivered_held,
            heads_held_max=self.store.statistics().heads_held_max,
            tick=tick,
            dispatched=totals.dispatched,
            dispatch_batches=totals.dispatch_batches,
            dispatch_failures=totals.dispatch_failures,
            lateness_max_ms=dispatch.lateness_max_ms,
            lateness_mean_ms=dispatch.lateness_mean_ms,
            lateness_fired=dispatch.lateness_fired,
            fire_rounds=dispatch.fire_rounds,
            confirm_rounds=dispatch.confirm_rounds,
            message_log_fsyncs=self._writer.statistics().fsyncs if self._writer is not None else 0,
            filing_fsyncs=self.store.statistics().fsyncs + self.store.statistics().syncfs,
            lanes=dispatch.lanes,
            waiting=dispatch.waiting,
            in_outage=dispatch.in_outage,
            deleted_hours=totals.deleted_hours,
            deleted_segments=totals.deleted_segments,
            fsync_us={
                **({"message": self._writer.fsync_durations_us()} if self._writer is not None else {}),
                **self.store.fsync_durations_us(),
            },
            log_bytes=self.store.log_bytes(),
            schedule_waits=self._schedule_waits,
        )

    def counters(self) -> SchedulerCounters:
        """Totals since the data folder was created (what the lmdb state keeps)."""
        dispatch = self.dispatcher.statistics()
        return self._totals(dispatch.dispatched, dispatch.batches, dispatch.failures)

    def _totals(self, dispatched: int, batches: int, failures: int) -> SchedulerCounters:
        """What was saved when this process started, ended sessions, and this one's counts."""
        return (
            self._counted_before
            + self._ended_sessions
            + SchedulerCounters(
                schedule_requests=self._requests,
                scheduled=self._scheduled,
                rewritten=self._rewritten,
                filed=self._filed_by_closed_stores + self.store.statistics().filed,
                dispatched=dispatched,
                dispatch_batches=batches,
                dispatch_failures=failures,
                deleted_hours=self._deleted_hours,
                deleted_segments=self._deleted_segments,
                cut_records=self._cut_records,
                cut_bytes=self._cut_bytes,
            )
        )

    async def unfiled(self) -> Unfiled:
        """What replay has yet to file: bytes and records between the checkpoint and the log end."""
        return await self._run_blocking(partial(unfiled, self._log, self.store))

    def _replication_statistics(
        self, master: MasterSession | None, slave: SlaveSession | None, totals: SchedulerCounters
    ) -> dict[str, Any]:
        member = self.member
        info: dict[str, Any] = {
            "mode": member.mode,
            "min_insync": member.min_insync,
            "durable_end": self._log.flushed_offset,
            "history": member.history.entries,
            "cut_records": totals.cut_records,
            "cut_bytes": totals.cut_bytes,
        }
        if master is not None:
            source = master.source.statistics()
            info["high_watermark"] = source.high_watermark
            info["replicas"] = [asdict(replica) for replica in source.replicas]
            info["accepting"] = master.accepting
        if slave is not None:
            fetched = slave.fetcher.statistics()
            held = slave.held_tick
            info["master_durable_end"] = fetched.master_durable_end
            info["lag_bytes"] = max(0, fetched.master_durable_end - self._log.flushed_offset)
            info["tick_age_ms"] = None if held is None else self._clock.monotonic_ms() - held.received_ms
            info["tick_behind_ms"] = None if held is None else max(0, self._clock.now_ms() - held.master_now_ms)
            info["held_dispatch_entries"] = member.records.held
            info["fetches"] = fetched.fetches
            info["fetch_failures"] = fetched.failures
        return info

    def replica_info(self) -> dict[str, Any]:
        """The ``replica`` field of each heartbeat (metaserver contract)."""
        info: dict[str, Any] = {"offset": self._log.flushed_offset, "epoch": self.epoch, "mode": self.member.mode}
        session = self.session
        if isinstance(session, MasterSession):
            info["in_sync"] = session.source.in_sync()
            if session.handover.handed_over is not None:
                info["handed_over"] = session.handover.handed_over
        return info

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would.

        Every task is cancelled where it waits; the block's own code is cancelled too
        (``open_scheduler`` then returns quietly). Nothing more is written on the way
        out: no replay step, no dispatch-log record, no checkpoint. Files are closed
        (closing flushes nothing a killed process would not have left in the page
        cache), so the data folder can be opened again in the same process.
        """
        self.crashed = True
        if self._life is not None:
            self._life.cancel()

    async def cleanup(self) -> tuple[int, list[int]]:
        """Delete message-log segments below the checkpoint (and what slaves still need)
        and hours past retention. Returns (segments deleted, hours deleted). Hours the
        wheels still hold are kept.

        A master first rolls its active segment when that holds filed records (a small
        load may take days to fill one), so they go now, or once replay has filed the
        rest of it (``_delete_filed_segments``). A slave does not: its tail may yet have
        to be cut back when its master changes."""
        now = self._clock.now_ms()
        keep = set(self.wheels.hours())
        below = self._deletable_below()
        message_log = self._log
        if isinstance(self.session, MasterSession) and isinstance(message_log, MessageLog):
            base, size = message_log.segments()[-1]
            if size and base < below:
                await self._run_blocking(message_log.roll)
        segments, hours = await self._run_blocking(partial(self._delete_old, now, keep, below))
        self._deleted_segments += segments
        self._deleted_hours += len(hours)
        if segments or hours:
            log.info(
                "scheduler %s: deleted %d message-log segment(s) below offset %d and %d hour(s) "
                "delivered more than %.0f h ago: %s",
                self.group,
                segments,
                below,
                len(hours),
                self._retention_ms / 3_600_000,
                " ".join(hour_name(hour) for hour in hours) or "-",
            )
        return segments, hours

    def _deletable_below(self) -> int:
        """The message-log offset below which every record is filed and no slave heard from
        lately still needs it: segments wholly below it may go."""
        below = self.store.checkpoint
        if isinstance(self.session, MasterSession):
            needed = self.session.source.retain_from()
            if needed is not None:
                below = min(below, needed)
        return below

    # --------------------------------------------------------------- SCHEDULE

    def _master(self, what: str) -> MasterSession:
        session = self.session
        if isinstance(session, MasterSession) and session.accepting:
            return session
        if isinstance(session, MasterSession):
            state = "is handing over to another member"
        elif isinstance(session, SlaveSession):
            state = f"is a slave (its master is {session.master})"
        else:
            state = "is not master now (waiting for the metaserver's word)"
        raise NotMaster(f"{what}: scheduler {self.address or '-'} of group {self.group} {state}; ask the metaserver")

    async def _schedule(self, request: Request) -> dict[str, Any]:
        session = self._master("SCHEDULE")
        body = request.batch_body()
        batch = scan_batch(body, self._limits, now_ms=self._clock.now_ms())  # refuses deliver_at beyond the horizon
        await self._filing_room(session)
        now = self._clock.now_ms()
        deliver_ats = batch.deliver_ats
        latest = max(deliver_ats)
        if latest > MAX_DELIVER_AT:
            index = deliver_ats.index(latest)
            raise RemoteProtocolError(
                f"record {index}: deliver_at {latest} is past {MAX_DELIVER_AT} (9999-12-31 UTC), "
                "the last hour a schedule log can be named for",
                code="limit",
                field="deliver_at",
                limit=MAX_DELIVER_AT,
                index=index,
            )
        keys, hashes = _index_keys(batch)
        session.source.check_insync("SCHEDULE")
        await session.mastership.confirm()
        fresh, overlap = await self._fresh(session, keys, batch.subjects)
        if self.session is not session or not session.accepting:
            raise NotMaster(f"SCHEDULE: scheduler {self.address or '-'} stopped being master; ask the metaserver")
        count = len(fresh)
        duplicates = count - sum(fresh)
        self.duplicates += duplicates
        starts, ends, attempts = batch.starts, batch.ends, batch.attempts
        kept: Sequence[int]
        if not duplicates:  # the common case: every record kept, nothing to pick per record
            results = ["scheduled"] * count
            kept = range(count)
            kept_keys, kept_hashes, kept_ats, kept_subjects = keys, hashes, deliver_ats, batch.subjects
        else:
            results = ["scheduled" if new else "duplicate" for new in fresh]
            kept = [i for i, new in enumerate(fresh) if new]
            kept_keys = [keys[i] for i in kept]
            kept_hashes = [hashes[i] for i in kept]
            kept_ats = [deliver_ats[i] for i in kept]
            kept_subjects = [batch.subjects[i] for i in kept]
        if not kept:  # a "duplicate" is an answer too: its first copy is replicated
            await session.source.confirm_replicated(
                self._log.end_offset, timeout_ms=self._replication_timeout_ms, what=f"SCHEDULE at {self.address or '-'}"
            )
            self._requests += 1
            return {"results": results, "group": self.group}
        data: bytes = batch.buf
        overdue = min(deliver_ats) < now
        if duplicates or overdue:
            # "Deliver now": filed at the time of receipt, never into a finished hour.
            parts = []
            for i in kept:
                record = data[starts[i] : ends[i]]
                if deliver_ats[i] < now:
                    record = rewrite_delivery(record, deliver_at=now, attempts=attempts[i])
                    self._rewritten += 1
                parts.append(record)
            data = b"".join(parts)
        assert self._writer is not None
        done = session.appending.start(kept_keys)
        try:
            # Shielded: once handed to the writer the batch may reach the log, and then the
            # tail must say so (a retry of it is a duplicate).
            with trio.CancelScope(shield=True):
                offset = await self._writer.append(data)  # queued at once: a session that ends later waits for it
        except StorageError as error:  # the disk failed (full?): retried here later, or another group takes it
            raise storage_refusal("SCHEDULE: the message log could not store the batch", error) from error
        finally:
            session.appending.end(done)
        end = offset + len(data)
        # The tail holds the batch once for all its keys: each filed at max(deliver_at, now).
        ats = [at if at > now else now for at in kept_ats] if overdue else kept_ats
        appended = ScheduledBatch(kept_keys, ats, kept_hashes, kept, starts, ends, offset, end, kept_subjects)
        await self._logged(session, appended, end, "SCHEDULE", overlap=overlap)
        self._requests += 1
        self._scheduled += len(kept)
        self._wake_housekeeping()
        return {"results": results, "group": self.group}

    async def _filing_room(self, session: MasterSession) -> None:
        """Backpressure: a SCHEDULE waits while replay is more than ``max_unfiled_bytes``
        behind the message log's end, so what is accepted and not yet filed (the unfiled
        tail's memory, and replay reading from the log's memory, not its file) stays bounded
        when producers send faster than filing keeps up (many hours at once). Refused as
        ``unavailable`` (retried by the client, nothing stored) after ``FILING_WAIT_MS``."""
        log, store = self._log, self.store
        if log.end_offset - store.checkpoint <= self._max_unfiled_bytes:
            return
        self._schedule_waits += 1
        with trio.move_on_after(FILING_WAIT_MS / 1000):
            while log.end_offset - store.checkpoint > self._max_unfiled_bytes:
                await session.step_filed.wait()
            return
        behind = log.end_offset - store.checkpoint
        raise RemoteProtocolError(
            f"SCHEDULE: filing is {behind} bytes behind (limit {self._max_unfiled_bytes}) after waiting "
            f"{FILING_WAIT_MS} ms; nothing of the batch was stored, retry",
            code="unavailable",
            field="max_unfiled_bytes",
            limit=self._max_unfiled_bytes,
        )

    async def _logged(
        self,
        session: MasterSession,
        entries: list[tuple[str, TailEntry]] | ScheduledBatch,
        end: int,
        command: str,
        *,
        overlap: bool = True,
    ) -> None:
        """What a SCHEDULE, CANCEL or MOVE appended (up to ``end``): in the unfiled tail for
        replay, then replicated as the policy asks, before the answer. ``overlap`` False: no
        key of a SCHEDULE's batch was in the tail or came twice (``fresh_records``)."""
        session.tail.add(entries, end, overlap=overlap)
        session.source.poke()
        session.replay_alarm.poke()
        await session.source.confirm_replicated(
            end, timeout_ms=self._replication_timeout_ms, what=f"{command} at {self.address or '-'}"
        )
        if self.session is not session:
            raise NotMaster(f"{command}: scheduler {self.address or '-'} stopped being master while the write waited")

    async def _fresh(self, session: MasterSession, keys: list[str], subjects: Sequence[str]) -> tuple[list[bool], bool]:
        """Which records are new: not a (subject, id) already scheduled and not yet delivered
        (in the index or the unfiled tail), nor the same twice in the batch; and whether a key
        was in the tail or came twice (``fresh_records``). A record whose id is being appended
        right now waits for that append: a duplicate only once it is stored."""
        tail, appending = session.tail, session.appending
        store = self.store
        found: Found
        while True:
            busy = appending.waiting_for(keys)
            if busy is not None:
                await busy.wait()
                continue
            checkpoint = store.checkpoint  # what the index holds at least, read below
            if store.past_every_indexed(keys):  # new time-ordered ids: none indexed, no thread needed
                found = None
                break
            epoch = tail.begin_lookup()
            try:
                found = await self._run_blocking(partial(look_up_fresh, store, keys, subjects))
            finally:
                tail.end_lookup(epoch)
            if appending.waiting_for(keys) is None:
                break
        return fresh_records(tail, keys, subjects, found, checkpoint)

    async def _fetch(self, request: Request) -> tuple[dict[str, Any], bytes]:
        # Before anything else: the answer holds this group's whole message log, and the
        # fetcher's offset holds back its deletion (``ReplicationSource.retain_from``).
        require_server(request.identity, "FETCH", ServerKind.SCHEDULER, self.group)
        fetch = FetchRequest.from_metadata(request.metadata)
        session = self.session
        if not isinstance(session, MasterSession):
            raise NotMaster(f"FETCH: scheduler {self.address or '-'} of group {self.group} is not master now")
        if fetch.group != self.group:
            raise RemoteProtocolError(
                f"FETCH for group {fetch.group!r} at a member of group {self.group!r}",
                code="bad_request",
                field="group",
            )
        answer, body = await session.source.serve_fetch(fetch)
        return answer.as_metadata(), body

    # --------------------------------------------------------------- STATUS

    async def _status(self, request: Request) -> dict[str, Any]:
        wanted = parse_status_request(request.metadata)
        hours = self.wheels.hours()[:wanted]
        store = self.store
        pending = await self._run_blocking(lambda: [store.pending(hour) for hour in hours])
        statistics = self.statistics()
        try:
            left = await self.unfiled()
        except StorageError as error:  # the checkpoint's records were deleted: replay reports it too
            log.warning("scheduler %s: cannot count the records not yet filed: %s", self.group, error)
        else:
            statistics = replace(
                statistics, unfiled_bytes=left.bytes, unfiled_records=left.records, unfiled_exact=left.exact
            )
        now = self._clock.now_ms()
        return status_answer(statistics, now_ms=now, hours=hours, pending=pending, open_hours=self.wheels.open_hours())

    # --------------------------------------------------------------- roles

    async def _role_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the session the metaserver's word calls for (``RoleLoop``)."""
        await self.roles.run(self.registration, task_status=task_status)

    @property
    def session(self) -> MasterSession | SlaveSession | None:
        return self.roles.session

    async def _between_sessions(self, ended: MasterSession | SlaveSession | None) -> None:
        if isinstance(ended, MasterSession) and ended.dispatcher is not None:
            # Its dispatcher's counts stay in the totals (``statistics`` no longer sees it).
            done = ended.dispatcher.statistics()
            self._ended_sessions += SchedulerCounters(
                dispatched=done.dispatched, dispatch_batches=done.batches, dispatch_failures=done.failures
            )
        self._wake_housekeeping()
        if isinstance(ended, MasterSession):
            log.warning("scheduler %s: no longer master of epoch %d: dispatch stopped", self.group, ended.epoch)
        writer = self._writer  # SCHEDULEs queued by the old master land before a fetcher appends
        while writer is not None and writer.statistics().pending:
            await self._clock.sleep_ms(5)

    def _session_for(self, view: MembershipView) -> MasterSession | SlaveSession | None:
        if view.role == "master":
            if self._fenced_epoch is not None and view.epoch <= self._fenced_epoch:
                return None  # a realtime server has seen a newer epoch: wait for the metaserver to catch up
            return self._master_session(view.epoch)
        if view.role == "slave" and view.master and view.master != self.address:
            return SlaveSession(self.member, master=view.master, epoch=view.epoch, on_cut=self._cut_back)
        return None

    def _master_session(self, epoch: int) -> MasterSession:
        session = MasterSession(
            self.member,
            epoch=epoch,
            make_wheels=self._make_wheels,
            make_dispatcher=self._make_dispatcher,
            deliver=self._deliver,
        )
        session.source.on_stale_epoch = self._stale
        return session

    def fenced(self, epoch: int, highest: int) -> None:
        """A realtime server refused this master's epoch: stop dispatching at once."""
        if self._fenced_epoch is None or epoch > self._fenced_epoch:
            self._fenced_epoch = epoch
        log.warning(
            "scheduler %s: a realtime server has seen epoch %d, this master holds %d: it was replaced; "
            "dispatch stops, rejoining as a slave",
            self.group, highest, epoch,
        )  # fmt: skip
        if isinstance(self.session, MasterSession) and self.session.epoch <= epoch:
            self.session.accepting = False
            if self.registration is not None:
                self.registration.heartbeat_now()
        self.roles.kick()

    def _stale(self, epoch: int) -> None:
        if self.registration is not None:
            self.registration.heartbeat_now()

    async def _cut_back(self, offset: int) -> None:
        """A slave's log holds a tail its master never had: cut it (and, under async
        replication, the entries already filed from it), count it, log it."""
        filed = offset < self.store.checkpoint
        async with self.member.filing:
            records, size, entries = await self._run_blocking(partial(self._cut, offset, filed))
        self._cut_records += records
        self._cut_bytes += size
        log.warning(
            "scheduler %s: cut %d record(s) (%d bytes) from offset %d that the master never had%s",
            self.group, records, size, offset,
            f", {entries} of them already filed (async replication: they are lost)" if filed else
            " (never acknowledged as replicated)",
        )  # fmt: skip

    def _cut(self, offset: int, filed: bool) -> tuple[int, int, int]:
        member = self.member
        records = sum(1 for _ in member.log.iter_from(offset))
        entries = 0
        if filed:
            folder = member.store.directory
            self._filed_by_closed_stores += member.store.statistics().filed
            member.store.close()
            entries = cut_schedule_folder(folder, offset)
            size = member.log.truncate(offset)
            # Ids whose last record was cut (their entries may be reused) and cancels that were cut:
            # before the store opens, which counts the cancelled entries.
            drop_from(member.state, offset, folder)
            lower_checkpoint(member.state, offset)
            member.store = self._stores["store"] = ScheduleStore.open(folder, member.state)
            member.store.recent_source = member.log.read_recent_many  # (as _open_storage sets it)
            member.records = DispatchRecords(member.store)
        else:
            size = member.log.truncate(offset)
            member.records.drop()
        return records, size, entries

    # --------------------------------------------------------------- background

    async def _housekeeping_loop(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """``cleanup`` every ``cleanup_interval_ms`` (the hours' check runs only then); in
        between, while there is work (SCHEDULE, dispatch rounds and session changes wake it),
        at most once a second: delete the segments replay has filed and save the counters
        if they changed. Idle, it sleeps until woken or the next cleanup."""
        task_status.started()
        clock = self._clock
        next_cleanup = clock.monotonic_ms() + self._cleanup_interval_ms
        failing = False
        while True:
            now = clock.monotonic_ms()
            try:
                if now >= next_cleanup:
                    next_cleanup = now + self._cleanup_interval_ms
                    await self.cleanup()
                else:
                    await self._delete_filed_segments()
            except StorageError as error:  # a disk error (or a full disk): the next round tries again
                if not failing:
                    log.warning("scheduler %s: cleanup failed, trying again: %s", self.group, error)
                failing = True
            else:
                if failing:
                    log.info("scheduler %s: cleanup works again", self.group)
                failing = False
            changed = await self._save_counters()
            # Something moved this second, or a rolled segment waits for replay (or a slave):
            # look again in a second; otherwise sleep until woken or the next cleanup.
            busy = changed or failing or len(self._log.segments()) > 1
            wait = next_cleanup - clock.monotonic_ms()
            if busy:
                wait = min(wait, COUNTERS_SAVE_MS)
            self._housekeeping_idle = not busy
            await self._housekeeping.wait_ms(max(0, wait))
            self._housekeeping_idle = False

    def _wake_housekeeping(self) -> None:
        """Something may have changed the counters or filed a segment: wake the idle housekeeper."""
        if self._housekeeping_idle:
            self._housekeeping_idle = False
            self._housekeeping.poke()

    async def _delete_filed_segments(self) -> int:
        """Delete the segments wholly below ``_deletable_below`` (nothing to do: no thread call)."""
        below = self._deletable_below()
        segments = self._log.segments()
        if len(segments) < 2 or sum(segments[0]) > below:
            return 0
        deleted: int = await self._run_blocking(partial(self._log.delete_before, below))
        self._deleted_segments += deleted
        return deleted

    async def _save_counters(self) -> bool:
        """Save the counters in the lmdb state if they changed since the last save; True if they had."""
        counters = self.counters()
        if counters == self._saved_counters:
            return False
        try:
            await self._run_blocking(partial(self.member.state.put, COUNTERS_DB, COUNTERS_KEY, counters.pack()))
        except StorageError as error:  # a full disk: kept in memory, saved once it has room
            if not self._counters_failing:
                log.warning("scheduler %s: cannot save its counters, trying again: %s", self.group, error)
            self._counters_failing = True
            return True
        if self._counters_failing:
            log.info("scheduler %s: counters saved again", self.group)
        self._counters_failing = False
        self._saved_counters = counters
        return True

    def _delete_old(self, now_ms: int, keep: set[int], below: int) -> tuple[int, list[int]]:
        segments = self._log.delete_before(below)
        deleted = []
        for hour in self.store.hours_to_delete(now_ms, retention_ms=self._retention_ms):
            if hour in keep:
                continue
            try:
                self.store.delete_hour(hour)
            except ScheduleError as error:  # being filed into right now: next time
                log.info("scheduler %s: hour %s not deleted now: %s", self.group, hour_name(hour), error)
                continue
            deleted.append(hour)
        return segments, deleted


def _index_keys(batch: Any) -> tuple[list[str], list[bytes | None]]:
    """Each record's index key and key hash; a ``key`` property that is no business key is refused.
    A record with neither attempts nor properties (most) has its id as index key and no hash."""
    keys: list[str] = list(batch.ids)
    hashes: list[bytes | None] = [None] * len(keys)
    buf = batch.buf
    unpack_key_fields = KEY_FIELDS.unpack_from
    for index, start in enumerate(batch.starts):
        attempts, _id_len, props_len = unpack_key_fields(buf, start + KEY_FIELDS_AT)
        if not attempts and not props_len:
            continue
        try:
            k, hashed, _key = record_key(buf, start, strict=True)
        except ValueError as error:
            raise RemoteProtocolError(
                f"record {index}: property key: {error}", code="bad_value", field="key", limit=MAX_KEY, index=index
            ) from None
        keys[index] = k
        hashes[index] = hashed
    return keys, hashes


async def _no_delivery(subject: str, body: bytes) -> list[str]:
    raise RuntimeError("this member is not master: it delivers nothing")


# ------------------------------------------------------------------- opening


@asynccontextmanager
async def open_scheduler(
    *,
    data_dir: str | Path,
    clock: Clock,
    listen: str | None = "127.0.0.1:0",
    group: str = "scheduler-1",
    meta_address: str | Sequence[str] | None = None,
    advertise_address: str | None = None,
    flush: FlushPolicy = "sync",
    limits: Limits = DEFAULT_LIMITS,
    load_ahead_ms: int = DEFAULT_LOAD_AHEAD_MS,
    hour_preload_ms: int = DEFAULT_HOUR_PRELOAD_MS,
    retention_ms: int = DEFAULT_RETENTION_MS,
    cleanup_interval_ms: int = DEFAULT_CLEANUP_INTERVAL_MS,
    dispatch_batch: int = DEFAULT_DISPATCH_BATCH,
    send_interval_ms: int = DEFAULT_SEND_INTERVAL_MS,
    send_ahead_ms: int = DEFAULT_SEND_AHEAD_MS,
    max_loaded: int = DEFAULT_MAX_LOADED,
    replay_bytes: int = DEFAULT_STEP_BYTES,
    max_unfiled_bytes: int = DEFAULT_MAX_UNFILED_BYTES,
    send_timeout: float = 10.0,
    segment_size: int = SCHEDULER_SEGMENT_SIZE,
    run_blocking: RunBlocking = run_in_thread,
    peers: AsyncCaller | None = None,
    replication: str = "sync",
    min_insync: int = 0,
    replication_timeout_ms: int = DEFAULT_REPLICATION_TIMEOUT_MS,
) -> AsyncIterator[Scheduler]:
    """Open the data folder, catch up, schedule and dispatch until the block ends.

    ``listen=None`` opens no listener (connections go to ``serve_stream``; give
    ``advertise_address`` to register). ``meta_address`` (one or several) is where the
    scheduler registers (kind ``scheduler``) and asks for realtime groups to deliver
    to; ``peers`` replaces the TCP connections to them (in-memory ones in tests).
    ``limits.horizon_ms`` is how far ahead a message may be scheduled. ``run_blocking``
    runs the disk work (default: a worker thread; ``run_inline`` for autojump tests).
    ``replay_bytes`` is how much of the message log one replay step files at most (the
    step's memory; one commit and fsync round per step). ``max_unfiled_bytes``: a SCHEDULE
    waits while replay is further behind than that (``Scheduler._filing_room``). ``segment_size``: the message
    log's segments; a folder written with another size takes this one (``_adopt_segment_size``).
    ``send_interval_ms``: a subject's SENDs to realtime start at least this far apart
    (what falls due meanwhile goes in one batch; ``Dispatcher``). ``send_ahead_ms``: each
    message is fired that long before its ``deliver_at`` (realtime holds it until then;
    at most ``MAX_SEND_AHEAD_MS``).
    """
    check_max_record(limits.max_record)
    if retention_ms < 0:
        raise ValueError(f"retention_ms must be >= 0, got {retention_ms}")
    if cleanup_interval_ms <= 0:
        raise ValueError(f"cleanup_interval_ms must be positive, got {cleanup_interval_ms}")
    if send_timeout <= 0:
        raise ValueError(f"send_timeout must be positive, got {send_timeout}")
    if send_interval_ms < 0:
        raise ValueError(f"send_interval_ms must be >= 0, got {send_interval_ms}")
    if not 0 <= send_ahead_ms <= MAX_SEND_AHEAD_MS:
        raise ValueError(f"send_ahead_ms must be between 0 and {MAX_SEND_AHEAD_MS}, got {send_ahead_ms}")
    if replay_bytes < 1:
        raise ValueError(f"replay_bytes must be at least 1, got {replay_bytes}")
    if max_unfiled_bytes < 1:
        raise ValueError(f"max_unfiled_bytes must be at least 1, got {max_unfiled_bytes}")
    if replication not in ("sync", "async"):
        raise ValueError(f"replication must be 'sync' or 'async', got {replication!r}")
    if min_insync < 0:
        raise ValueError(f"min_insync must be >= 0, got {min_insync}")
    if replication_timeout_ms <= 0:
        raise ValueError(f"replication_timeout_ms must be positive, got {replication_timeout_ms}")
    bind = split_listen(listen) if listen is not None else None
    if listen is None and meta_address is not None and advertise_address is None:
        raise ValueError("listen=None with a meta_address needs an advertise_address to register")
    # Check the wheel settings before touching the data folder.
    WheelSet(load_ahead_ms=load_ahead_ms, hour_preload_ms=hour_preload_ms, max_loaded=max_loaded)
    root = Path(data_dir)
    current: dict[str, ScheduleStore] = {}  # the store now open (a cut-back opens it again)
    async with open_blocking(
        partial(_open_storage, root, segment_size),
        lambda opened: _close_storage(opened[0], opened[1], current.get("store", opened[2])),
        run_blocking=run_blocking,
    ) as (message_log, state, store):
        current["store"] = store
        history, member_id = await run_blocking(partial(member_identity, root, state))
        counters = await run_blocking(partial(_load_counters, state, group))
        async with AsyncExitStack() as stack:
            if peers is None:
                # Registration, delivery and replication FETCH pace their own retries: no redial
                # wait of the transport's under them (after a restart they would come back late).
                peers = await stack.enter_async_context(
                    open_peers(limits=limits, request_timeout=send_timeout, **CLIENT_PEERS_OPTIONS)
                )
            member = Member(
                group=group,
                address=advertise_address or "",
                clock=clock,
                log=message_log,
                state=state,
                store=store,
                history=history,
                records=DispatchRecords(store),
                run_blocking=run_blocking,
                peers=peers,
                registration=None,
                replay_bytes=replay_bytes,
                mode=replication,
                min_insync=min_insync,
            )
            routes = None
            if meta_address is not None:
                addresses = [meta_address] if isinstance(meta_address, str) else list(meta_address)
                routes = RouteClient(peers, addresses, clock=clock)

            def make_wheels(hours: list[int]) -> WheelSet:
                return WheelSet(
                    hours, load_ahead_ms=load_ahead_ms, hour_preload_ms=hour_preload_ms, max_loaded=max_loaded
                )

            def make_dispatcher(
                wheels: WheelSet, deliver: Deliver, on_recorded: Callable[[dict[int, list[int]]], None]
            ) -> Dispatcher:
                def recorded(rounds: dict[int, list[int]]) -> None:
                    on_recorded(rounds)
                    scheduler.recent.recorded(rounds, clock.now_ms())
                    scheduler._wake_housekeeping()  # counters to save

                return Dispatcher(
                    store=member.store,  # a cut-back (async divergence) may have opened it again
                    wheels=wheels,
                    deliver=deliver,
                    clock=clock,
                    run_blocking=run_blocking,
                    dispatch_batch=dispatch_batch,
                    send_interval_ms=send_interval_ms,
                    send_ahead_ms=send_ahead_ms,
                    on_recorded=recorded,
                )

            def deliver_for(epoch: int, mastership: Mastership) -> Deliver:
                return _delivery(routes, group, epoch, mastership, send_timeout, lambda e, h: scheduler.fenced(e, h))

            scheduler = Scheduler(
                member=member,
                stores=current,
                limits=limits,
                retention_ms=retention_ms,
                cleanup_interval_ms=cleanup_interval_ms,
                replication_timeout_ms=replication_timeout_ms,
                make_wheels=make_wheels,
                make_dispatcher=make_dispatcher,
                deliver=deliver_for,
                counters=counters,
                max_unfiled_bytes=max_unfiled_bytes,
            )

            async def register(nursery: trio.Nursery, address: str) -> None:
                assert meta_address is not None
                member.address = address
                member.registration = scheduler.registration = await start_registration(
                    nursery,
                    peers,
                    group=group,
                    kind=ServerKind.SCHEDULER,
                    address=address,
                    meta_address=meta_address,
                    clock=clock,
                    member=member_id,
                    replica=scheduler.replica_info,
                )
                await nursery.start(scheduler._role_loop)

            tasks: list[Task] = [scheduler._housekeeping_loop]
            if meta_address is None:
                tasks.insert(0, scheduler._role_loop)  # standalone: master at once
            # The crash scope holds the writer too: nothing more is written on the way out.
            with trio.CancelScope() as life:
                scheduler._life = life
                async with open_log_writer(message_log, flush=flush, run_blocking=run_blocking) as writer:
                    scheduler._writer = member.writer = writer
                    async with serve_frames(
                        scheduler.frame_server,
                        bind=bind,
                        advertise_address=advertise_address,
                        tasks=tasks,
                        register=register if meta_address is not None else None,
                    ) as address:
                        member.address = address
                        log.info("scheduler %s serving on %s (data %s)", group, address or "-", root)
                        yield scheduler


def _delivery(
    routes: RouteClient | None,
    group: str,
    epoch: int,
    mastership: Mastership,
    send_timeout: float,
    fenced: Callable[[int, int], None],
) -> Deliver:
    """SEND a subject's batch, fenced with this master's group and epoch, to a realtime group
    the metaserver routes it to; a fencing refusal stops this master (``fenced``)."""
    metadata = Fence(group, epoch).as_metadata() if epoch else {}

    async def deliver(subject: str, body: bytes) -> list[str]:
        if routes is None:
            raise NoRouteError("no metaserver address (meta_address) was given: no realtime group is known")
        await mastership.confirm()
        try:
            frame = await routes.call(
                DELIVERY_ROUTE, Command.SEND, metadata, body, subject=subject, timeout=send_timeout
            )
        except PeerError as error:
            if error.code == FENCED:
                highest = error.limit if isinstance(error.limit, int) else epoch + 1
                fenced(epoch, highest)
            raise
        results = frame.metadata.get("results")
        if not isinstance(results, list):
            raise RemoteProtocolError("SEND answer holds no 'results' list", code="bad_metadata", field="results")
        return results

    return deliver


def _open_storage(root: Path, segment_size: int) -> tuple[MessageLog, StateStore, ScheduleStore]:
    root.mkdir(parents=True, exist_ok=True)
    opened: list[Any] = []
    try:
        _adopt_segment_size(root / "messages", segment_size)
        opened.append(MessageLog.open(root / "messages", segment_size=segment_size))
        opened[0].keep_recent(REPLAY_RECENT_BYTES)  # replay files what was just appended from memory
        opened.append(StateStore.open(root / "state", extra_format={"scheduler_state": 1}))
        opened.append(ScheduleStore.open(root / "schedule", opened[1]))
        opened[2].recent_source = opened[0].read_recent_many  # what is due soon is loaded from memory
    except BaseException:
        for thing in reversed(opened):
            thing.close()
        raise
    return opened[0], opened[1], opened[2]


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


def _load_counters(state: StateStore, group: str) -> SchedulerCounters:
    """The counters saved in the lmdb state (zeros for a new folder, or one whose record is unreadable)."""
    data = state.get(COUNTERS_DB, COUNTERS_KEY)
    if data is None:
        return SchedulerCounters()
    try:
        return SchedulerCounters.unpack(data)
    except ValueError as error:
        log.warning("scheduler %s: saved counters unreadable (%s): counting again from zero", group, error)
        return SchedulerCounters()


def _close_storage(message_log: SegmentedLog, state: StateStore, store: ScheduleStore) -> None:
    try:
        store.close()
    finally:
        try:
            message_log.close()
        finally:
            state.close()


__all__ = ["DELIVERY_ROUTE", "Scheduler", "SchedulerStatistics", "open_scheduler"]
