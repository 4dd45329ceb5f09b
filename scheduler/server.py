"""The scheduler (delay server): SCHEDULE, CANCEL, MOVE, QUERY, FETCH and STATUS over the shared transport.

``open_scheduler`` opens the data folder (``store.SchedulerStorage``: ``messages/`` the
write-ahead message log, ``state/`` lmdb, ``schedule/`` the hourly schedule logs;
docs/scheduler-storage.md) and runs one member of a scheduler group until its block
ends. The metaserver says whether the member is master or slave
(``delaymq.scheduler.roles``: a slave fetches the master's log and files it, a promoted
one takes over; docs/replication.md); a scheduler without a metaserver is master for
good. The member runs in the shell every replicated server shares
(``delaymq.replication.shell.ReplicatedServer``: its role and epoch, FETCH,
registration, the crash scope). As master, each part in a module of its own:

- **SCHEDULE** (``schedule.ScheduleHandler``) checks a batch and appends it to the
  message log; **CANCEL**, **MOVE** and **QUERY** (``changes.ChangeHandler``).
- **replay** (``roles.MasterSession``) files the message log into the schedule logs and
  tells the dispatcher of every entry filed.
- the **dispatcher** (``delaymq.scheduler.dispatcher``) fires each message at its
  millisecond and hands it to a realtime server.
- **housekeeping** (``housekeeping.Housekeeping``) deletes filed segments and hours past
  retention, and saves the counters.
- **STATUS** (``status``) reports the tick, the pending count of the next hours, what is
  not yet filed, the counters.

On start every hour not fully dispatched is loaded again, whatever its age, and the
dispatch logs say what to skip; overdue messages go out at once, oldest first.
Shutdown writes nothing the server would not also have written had it been killed
(``crash`` is the test hook for a kill). Docs: docs/scheduler.md.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import trio

from delaymq.client.registration import Registration
from delaymq.client.routes import CLIENT_PEERS_OPTIONS, RouteClient
from delaymq.clock import Clock
from delaymq.net.peers import AsyncCaller, open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.serving import Task, serve_frames
from delaymq.protocol.commands import Command
from delaymq.protocol.routes import ServerKind
from delaymq.replication.membership import member_identity
from delaymq.replication.roles import Mastership, Role, RoleLoop
from delaymq.replication.shell import ReplicatedServer
from delaymq.replication.statistics import CutCounts, ReplicationStatistics
from delaymq.scheduler.cancels import RecentDispatches
from delaymq.scheduler.changes import ChangeHandler
from delaymq.scheduler.counters import SchedulerCounters, dispatch_counters
from delaymq.scheduler.current import CurrentSession, Session, SessionRole
from delaymq.scheduler.delivery import DELIVERY_ROUTE, no_delivery, realtime_delivery
from delaymq.scheduler.dispatcher import Deliver, Dispatcher
from delaymq.scheduler.housekeeping import Housekeeping
from delaymq.scheduler.replay import Unfiled, unfiled
from delaymq.scheduler.replica import DispatchRecords
from delaymq.scheduler.roles import MasterSession, Member, SlaveSession
from delaymq.scheduler.schedule import ScheduleHandler
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.settings import SCHEDULER_SEGMENT_SIZE, SchedulerSettings
from delaymq.scheduler.status import (
    SchedulerStatistics,
    parse_status_request,
    status_answer,
    take_statistics,
    tick_lag,
)
from delaymq.scheduler.store import CutBack, SchedulerStorage
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.errors import StorageError
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.storage.writer import open_log_writer

log = logging.getLogger(__name__)


class Scheduler:
    """One scheduler member. Build it with ``open_scheduler``.

    Its role, epoch, FETCH, heartbeat report and crash hook are the shell's
    (``delaymq.replication.shell.ReplicatedServer``); the requests of a master,
    dispatch and STATUS are its own."""

    def __init__(
        self,
        *,
        member: Member,
        storage: SchedulerStorage,
        settings: SchedulerSettings,
        counters: SchedulerCounters,
        routes: RouteClient | None,
    ) -> None:
        self.member = member
        self.group = member.group
        self.storage = storage
        self.settings = settings
        self._routes = routes  # where delivery finds realtime groups (None: no metaserver)
        self._fenced_epoch: int | None = None
        #: Totals saved in lmdb when this process started; ``counters()`` adds this process's.
        self._counted_before = counters
        self._ended_sessions = SchedulerCounters()  # dispatch counts of ended master sessions
        #: When realtime accepted the latest dispatches (QUERY's and CANCEL's ``dispatched_at``).
        self.recent = RecentDispatches()
        self.shell: ReplicatedServer[MasterSession, SlaveSession] = ReplicatedServer(
            member,
            kind=ServerKind.SCHEDULER,
            name="scheduler",
            log=member.log,
            master_type=MasterSession,
            slave_type=SlaveSession,
            make_master=self._master_session,
            make_slave=lambda master, epoch: SlaveSession(member, master=master, epoch=epoch, on_cut=self._cut_back),
            # A realtime server has seen a newer epoch than one it was fenced at: wait for the metaserver to catch up.
            may_lead=lambda epoch: self._fenced_epoch is None or epoch > self._fenced_epoch,
            session_ended=self._between_sessions,
            not_accepting="is handing over to another member",
        )
        idle_wheels = settings.make_wheels([])
        self.current = CurrentSession(
            member,
            self.shell,
            idle_wheels=idle_wheels,
            idle_dispatcher=self._make_dispatcher(idle_wheels, no_delivery, lambda rounds: None),
            replication_timeout_ms=settings.replication_timeout_ms,
        )
        self.housekeeping = Housekeeping(
            current=self.current,
            retention_ms=settings.retention_ms,
            cleanup_interval_ms=settings.cleanup_interval_ms,
            counters=self.counters,
            saved=counters,
            save=storage.save_counters,
        )
        self.schedule_handler = ScheduleHandler(
            current=self.current,
            clock=member.clock,
            limits=settings.limits,
            run_blocking=member.run_blocking,
            max_unfiled_bytes=settings.max_unfiled_bytes,
            on_appended=self.housekeeping.wake,
        )
        self.frame_server = self._frame_server()

    def _frame_server(self) -> FrameServer:
        member, limits = self.member, self.settings.limits
        changes = ChangeHandler(
            current=self.current,
            clock=member.clock,
            limits=limits,
            run_blocking=member.run_blocking,
            recent=self.recent,
        )
        return FrameServer(
            {
                Command.SCHEDULE: self.schedule_handler.handle,
                Command.STATUS: self._status,
                Command.FETCH: self.shell.serve_fetch,
                Command.CANCEL: changes.cancel,
                Command.MOVE: changes.move,
                Command.QUERY: changes.query,
            },
            limits=limits,
        )

    # --------------------------------------------------------------- public

    @property
    def address(self) -> str:
        return self.member.address

    @property
    def store(self) -> ScheduleStore:
        return self.member.store

    @property
    def registration(self) -> Registration | None:
        """The metaserver's latest word (None without a meta_address, or before registering)."""
        return self.member.registration

    @property
    def roles(self) -> RoleLoop[Session]:
        return self.shell.roles

    @property
    def session(self) -> Session | None:
        return self.shell.session

    @property
    def role(self) -> Role:
        """What the member does now: ``master`` only while it takes requests (``Role``)."""
        return self.shell.role

    @property
    def epoch(self) -> int:
        return self.shell.epoch

    @property
    def crashed(self) -> bool:
        return self.shell.crashed

    @property
    def wheels(self) -> WheelSet:
        return self.current.wheels

    @property
    def dispatcher(self) -> Dispatcher:
        return self.current.dispatcher

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> SchedulerStatistics:
        """A snapshot; ``unfiled_records`` is -1 (counting reads the log: ``unfiled()``, STATUS)."""
        dispatch = self.current.dispatcher.statistics()
        totals = self._totals(dispatch_counters(dispatch))
        return take_statistics(
            member=self.member,
            session=self.current.role,
            role=self.role,
            replication=self._replication_statistics(totals),
            wheels=self.current.wheels,
            dispatch=dispatch,
            totals=totals,
            master_address=self.registration.master_address if self.registration is not None else self.address,
            schedule_waits=self.schedule_handler.waits,
        )

    def _replication_statistics(self, totals: SchedulerCounters) -> ReplicationStatistics:
        """The shell's, with the scheduler's own parts: the cut-backs (totals kept across
        restarts) and, as a slave, the master's tick."""
        slave = self.shell.slave_session
        return self.shell.replication_statistics(
            cut=CutCounts(records=totals.cut_records, bytes=totals.cut_bytes),
            tick=tick_lag(self.member, slave) if slave is not None else None,
        )

    def counters(self) -> SchedulerCounters:
        """Totals since the data folder was created (what the lmdb state keeps)."""
        return self._totals(dispatch_counters(self.current.dispatcher.statistics()))

    def _totals(self, dispatched: SchedulerCounters) -> SchedulerCounters:
        """What was saved when this process started, ended sessions, and this one's counts."""
        return (
            self._counted_before
            + self._ended_sessions
            + self.schedule_handler.counters()
            + self.storage.counters()
            + dispatched
            + self.housekeeping.counters()
        )

    async def unfiled(self) -> Unfiled:
        """What replay has yet to file: bytes and records between the checkpoint and the log end."""
        return await self.member.run_blocking(partial(unfiled, self.member.log, self.store))

    async def cleanup(self) -> tuple[int, list[int]]:
        """Delete filed message-log segments and hours past retention now (``Housekeeping.cleanup``)."""
        return await self.housekeeping.cleanup()

    def replica_info(self) -> dict[str, Any]:
        """The ``replica`` field of each heartbeat (metaserver contract)."""
        return self.shell.replica_info()

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would.

        Every task is cancelled where it waits; the block's own code is cancelled too
        (``open_scheduler`` then returns quietly). Nothing more is written on the way
        out: no replay step, no dispatch-log record, no checkpoint. Files are closed
        (closing flushes nothing a killed process would not have left in the page
        cache), so the data folder can be opened again in the same process.
        """
        self.shell.crash()

    # --------------------------------------------------------------- STATUS

    async def _status(self, request: Request) -> dict[str, Any]:
        wanted = parse_status_request(request.metadata)
        hours = self.wheels.hours()[:wanted]
        store = self.store
        pending = await self.member.run_blocking(lambda: [store.pending(hour) for hour in hours])
        statistics = self.statistics()
        try:
            left = await self.unfiled()
        except StorageError as error:  # the checkpoint's records were deleted: replay reports it too
            log.warning("scheduler %s: cannot count the records not yet filed: %s", self.group, error)
        else:
            statistics = replace(
                statistics, unfiled_bytes=left.bytes, unfiled_records=left.records, unfiled_exact=left.exact
            )
        now = self.member.clock.now_ms()
        return status_answer(statistics, now_ms=now, hours=hours, pending=pending, open_hours=self.wheels.open_hours())

    # --------------------------------------------------------------- roles

    async def _between_sessions(self, ended: Session | None) -> None:
        master = SessionRole.of(ended).master
        if master is not None and master.dispatcher is not None:
            # Its dispatcher's counts stay in the totals (``statistics`` no longer sees it).
            self._ended_sessions += dispatch_counters(master.dispatcher.statistics())
        self.housekeeping.wake()
        if master is not None:
            log.warning("scheduler %s: no longer master of epoch %d: dispatch stopped", self.group, master.epoch)

    def _master_session(self, epoch: int) -> MasterSession:
        return MasterSession(
            self.member,
            epoch=epoch,
            make_wheels=self.settings.make_wheels,
            make_dispatcher=self._make_dispatcher,
            deliver=self._delivery,
        )

    def _make_dispatcher(
        self, wheels: WheelSet, deliver: Deliver, on_recorded: Callable[[dict[int, list[int]]], None]
    ) -> Dispatcher:
        settings, clock = self.settings, self.member.clock

        def recorded(rounds: dict[int, list[int]]) -> None:
            on_recorded(rounds)
            self.recent.recorded(rounds, clock.now_ms())
            self.housekeeping.wake()  # counters to save

        return Dispatcher(
            store=self.member.store,  # a cut-back (async divergence) may have opened it again
            wheels=wheels,
            deliver=deliver,
            clock=clock,
            run_blocking=self.member.run_blocking,
            dispatch_batch=settings.dispatch_batch,
            send_interval_ms=settings.send_interval_ms,
            send_ahead_ms=settings.send_ahead_ms,
            on_recorded=recorded,
        )

    def _delivery(self, epoch: int, mastership: Mastership) -> Deliver:
        return realtime_delivery(self._routes, self.group, epoch, mastership, self.settings.send_timeout, self.fenced)

    def fenced(self, epoch: int, highest: int) -> None:
        """A realtime server refused this master's epoch: stop dispatching at once."""
        if self._fenced_epoch is None or epoch > self._fenced_epoch:
            self._fenced_epoch = epoch
        log.warning(
            "scheduler %s: a realtime server has seen epoch %d, this master holds %d: it was replaced; "
            "dispatch stops, rejoining as a slave",
            self.group, highest, epoch,
        )  # fmt: skip
        master = self.shell.master_session
        if master is not None and master.epoch <= epoch:
            master.accepting = False
            if self.registration is not None:
                self.registration.heartbeat_now()
        self.shell.roles.kick()

    async def _cut_back(self, offset: int) -> None:
        """A slave's log holds a tail its master never had: cut it (and, under async
        replication, the entries already filed from it), count it, log it."""
        filed = offset < self.store.checkpoint
        async with self.member.filing:
            cut = await self.member.run_blocking(partial(self._cut, offset, filed))
        log.warning(
            "scheduler %s: cut %d record(s) (%d bytes) from offset %d that the master never had%s",
            self.group, cut.records, cut.size, offset,
            f", {cut.entries} of them already filed (async replication: they are lost)" if filed else
            " (never acknowledged as replicated)",
        )  # fmt: skip

    def _cut(self, offset: int, filed: bool) -> CutBack:
        """Cut the storage back and let the member use what it holds then (blocking)."""
        cut = self.storage.cut_back(offset, filed=filed)
        member = self.member
        if filed:
            member.store = self.storage.schedule
            member.records = DispatchRecords(member.store)
        else:
            member.records.drop()
        return cut

    # --------------------------------------------------------------- serving

    @asynccontextmanager
    async def _serving(self, member_id: str) -> AsyncIterator[str]:
        """Open the log writer, serve frames and run the tasks (and registration, with a
        metaserver) until the block ends; yields the address served at."""
        settings, member = self.settings, self.member

        async def register(nursery: trio.Nursery, address: str) -> None:
            assert settings.meta_address is not None
            await self.shell.register(nursery, address, meta_address=settings.meta_address, member_id=member_id)

        tasks: list[Task] = [self.housekeeping.run]
        if settings.meta_address is None:
            tasks.insert(0, self.shell.run_roles)  # standalone: master at once
        # The crash scope holds the writer too: nothing more is written on the way out.
        with self.shell.crash_scope():
            async with open_log_writer(member.log, flush=settings.flush, run_blocking=member.run_blocking) as writer:
                member.writer = writer
                async with serve_frames(
                    self.frame_server,
                    bind=settings.bind,
                    advertise_address=settings.advertise_address,
                    tasks=tasks,
                    register=register if settings.meta_address is not None else None,
                ) as address:
                    member.address = address
                    yield address


# ------------------------------------------------------------------- opening


@asynccontextmanager
async def open_scheduler(
    settings: SchedulerSettings | None = None,
    *,
    clock: Clock,
    run_blocking: RunBlocking = run_in_thread,
    peers: AsyncCaller | None = None,
    **options: Any,
) -> AsyncIterator[Scheduler]:
    """Open the data folder, catch up, schedule and dispatch until the block ends.

    ``options`` are ``SchedulerSettings`` fields (``data_dir`` at least), or change
    those of ``settings``. ``run_blocking`` runs the disk work (default: a worker thread;
    ``run_inline`` for autojump tests); ``peers`` replaces the TCP connections to the
    metaserver and the other servers (in-memory ones in tests).
    """
    settings = SchedulerSettings(**options) if settings is None else replace(settings, **options)
    root = settings.root
    async with open_blocking(
        partial(SchedulerStorage.open, root, segment_size=settings.segment_size),
        SchedulerStorage.close,
        run_blocking=run_blocking,
    ) as storage:
        history, member_id = await run_blocking(partial(member_identity, root, storage.state))
        counters = await run_blocking(partial(storage.load_counters, settings.group))
        async with AsyncExitStack() as stack:
            if peers is None:
                # Registration, delivery and replication FETCH pace their own retries: no redial
                # wait of the transport's under them (after a restart they would come back late).
                peers = await stack.enter_async_context(
                    open_peers(limits=settings.limits, request_timeout=settings.send_timeout, **CLIENT_PEERS_OPTIONS)
                )
            member = Member(
                group=settings.group,
                address=settings.advertise_address or "",
                clock=clock,
                log=storage.message_log,
                state=storage.state,
                store=storage.schedule,
                history=history,
                records=DispatchRecords(storage.schedule),
                run_blocking=run_blocking,
                peers=peers,
                registration=None,
                replay_bytes=settings.replay_bytes,
                mode=settings.replication,
                min_insync=settings.min_insync,
            )
            meta = settings.meta_addresses
            routes = RouteClient(peers, meta, clock=clock) if meta is not None else None
            scheduler = Scheduler(member=member, storage=storage, settings=settings, counters=counters, routes=routes)
            async with scheduler._serving(member_id) as address:
                log.info("scheduler %s serving on %s (data %s)", settings.group, address or "-", root)
                yield scheduler


__all__ = [
    "DELIVERY_ROUTE",
    "SCHEDULER_SEGMENT_SIZE",
    "Scheduler",
    "SchedulerSettings",
    "SchedulerStatistics",
    "open_scheduler",
]
