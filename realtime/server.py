"""The realtime server: SEND, PULL, ACK, NACK, CONSUMER_HEARTBEAT, QUERY, FETCH, STATUS, CLEAR_FENCE.

``open_realtime_server`` opens the data folder (``recovery.open_storage``) and runs one
member of a realtime group until its block ends, in the shell every replicated server
shares (``delaymq.replication.shell``: role, epoch, FETCH, registration, the crash hook).
The metaserver says whether the member is master or slave (``delaymq.realtime.roles``;
docs/replication.md): a master serves from a ``master.RealtimeMaster`` (the state a
restart recovers, and the handlers over it) and ships its log to its slaves (FETCH), its
consumer progress included; a slave copies the log, indexes it and applies that
progress, and refuses the rest with ``not_master``. A realtime server without a metaserver is master for good (epoch 0).
QUERY (``realtime.query``) says which consumer groups acked a message stored lately;
CLEAR_FENCE (``realtime.clearfence``) forgets a scheduler group's fence. FETCH (the
message log) is for a token that may be a server of this realtime group only.
Start-up and shutdown order follow the nesting: the log writer outlives the handlers,
and a master session's last checkpoint is written as it ends. Every blocking call
(fsync, lmdb, reads) goes through the ``run_blocking`` it is given.

STATUS (command 14, as the scheduler's) takes no metadata and answers
``{group, address, now_ms, fences: {scheduler group: epoch}, statistics: {...}}``:
``fences`` is the durable fence table, ``statistics`` ``RealtimeStatistics.to_wire``
(``role``, ``epoch`` and ``replication`` as the scheduler's).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.client.registration import Registration
from delaymq.client.routes import CLIENT_PEERS_OPTIONS, RouteClient, meta_addresses
from delaymq.clock import Clock
from delaymq.net.addresses import split_listen
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.peers import AsyncCaller, Peers, open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.serving import serve_frames
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import ServerKind
from delaymq.realtime.caps import DEFAULT_MAX_GROUPS, DEFAULT_MAX_SUBJECTS, check_cap
from delaymq.realtime.clearfence import serve_clear_fence
from delaymq.realtime.fences import load_fences
from delaymq.realtime.master import MasterSettings, RealtimeMaster
from delaymq.realtime.query import serve_query
from delaymq.realtime.recovery import open_storage
from delaymq.realtime.roles import MasterSession, Member, SlaveSession
from delaymq.realtime.statistics import COUNTERS, RealtimeStatistics
from delaymq.replication.membership import member_identity
from delaymq.replication.roles import Role, RoleLoop
from delaymq.replication.shell import ReplicatedServer
from delaymq.replication.statistics import CutCounts, ReplicationStatistics
from delaymq.storage.log import DEFAULT_SEGMENT_SIZE, check_max_record
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.storage.writer import FlushPolicy, open_log_writer

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Any]]

#: How long a SEND, a PULL's hand-outs or an ACK wait for ``min_insync`` slaves under sync replication.
DEFAULT_REPLICATION_TIMEOUT_MS = 5_000


class RealtimeServer:
    """One realtime member. Build it with ``open_realtime_server``.

    Its role, epoch, FETCH, heartbeat report and crash hook are the shell's
    (``delaymq.replication.shell.ReplicatedServer``); the requests of a master and
    STATUS are its own."""

    def __init__(self, member: Member, *, managed: bool, limits: Limits) -> None:
        self.member = member
        self.group = member.group
        self._clock = member.clock
        self.shell: ReplicatedServer[MasterSession, SlaveSession] = ReplicatedServer(
            member,
            kind=ServerKind.REALTIME,
            name="realtime server",
            log=member.storage.message_log,
            master_type=MasterSession,
            slave_type=SlaveSession,
            make_master=lambda epoch: MasterSession(member, epoch=epoch, managed=managed),
            make_slave=lambda master, epoch: SlaveSession(member, master=master, epoch=epoch),
            session_ended=self._session_ended,
        )
        self._cut = CutCounts(messages=0)  # cut back by ended slave sessions
        self.frame_server = FrameServer(
            {
                Command.SEND: self._send,
                Command.PULL: self._pull,
                Command.ACK: self._ack,
                Command.NACK: self._nack,
                Command.CONSUMER_HEARTBEAT: self._heartbeat,
                Command.FETCH: self.shell.serve_fetch,
                Command.STATUS: self._status,
                Command.QUERY: partial(serve_query, self),  # delaymq.realtime.query
                Command.CLEAR_FENCE: partial(serve_clear_fence, self),  # delaymq.realtime.clearfence
            },
            limits=limits,
        )

    # --------------------------------------------------------------- public

    @property
    def address(self) -> str:
        return self.member.address

    @property
    def registration(self) -> Registration | None:
        """The metaserver's latest word (None without a meta_address, or before registering)."""
        return self.member.registration

    @property
    def roles(self) -> RoleLoop[MasterSession | SlaveSession]:
        return self.shell.roles

    @property
    def session(self) -> MasterSession | SlaveSession | None:
        return self.shell.session

    @property
    def master(self) -> RealtimeMaster | None:
        """The state this member serves from while it is master (None otherwise)."""
        session = self.shell.master_session
        return session.master if session is not None else None

    @property
    def role(self) -> Role:
        return self.shell.role

    @property
    def epoch(self) -> int:
        return self.shell.epoch

    @property
    def crashed(self) -> bool:
        return self.shell.crashed

    @property
    def scheduler_routes(self) -> RouteClient | None:
        """Where retries go: a scheduler of the ``delayed-producer`` route (set up with a meta_address)."""
        return self.member.scheduler_routes

    @scheduler_routes.setter
    def scheduler_routes(self, routes: RouteClient | None) -> None:
        self.member.scheduler_routes = routes
        if self.master is not None:
            self.master.retries.scheduler_routes = routes

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would.

        Every task is cancelled where it waits, the block's own code too
        (``open_realtime_server`` then returns quietly), and nothing more is
        committed: no last checkpoint. What was written stays, as the page cache
        keeps it for the next process.
        """
        self.member.crashed = True
        self.shell.crash()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (tests use it with in-memory streams)."""
        await self.frame_server.serve_stream(stream)

    def statistics(self) -> RealtimeStatistics:
        master = self.master
        counters = master.counters() if master is not None else dict.fromkeys(COUNTERS, 0)
        writer = self.member.writer
        message_log = self.member.storage.message_log
        log_bytes = {"message": sum(size for _base, size in message_log.segments())}
        fsync_us = {"message": writer.fsync_durations_us()} if writer is not None else {}
        if master is not None:
            log_bytes.update(master.log_bytes())
            fsync_us["checkpoint"] = master.checkpoint_us.to_wire()
        return RealtimeStatistics(
            address=self.address,
            group=self.group,
            message_log_end=self.member.storage.message_log.end_offset,
            role=self.role.value,
            epoch=self.epoch,
            master=(self.registration.master_address if self.registration is not None else None) or self.address,
            replication=self._replication_statistics(),
            lateness_accepted=master.send_handler.lateness.to_wire() if master is not None else {},
            lateness_handed_out=master.pull_handler.lateness.to_wire() if master is not None else {},
            message_log_fsyncs=writer.statistics().fsyncs if writer is not None else 0,
            consumer_lag=master.consumer_lag() if master is not None else [],
            log_bytes=log_bytes,
            fsync_us=fsync_us,
            **counters,
        )

    def _replication_statistics(self) -> ReplicationStatistics:
        slave = self.shell.slave_session
        if slave is None:
            return self.shell.replication_statistics(cut=self._cut)
        return self.shell.replication_statistics(cut=self._cut + slave.cut, applied_offset=slave.applied_offset)

    def replica_info(self) -> dict[str, Any]:
        """The ``replica`` field of each heartbeat (metaserver contract)."""
        return self.shell.replica_info()

    # --------------------------------------------------------------- requests

    async def _serve(
        self, what: str, handler: Callable[[RealtimeMaster], Handler], request: Request, *, replicated: bool = True
    ) -> Any:
        """Run a master's ``handler`` for ``request``, counted in flight (a handover waits for it)."""
        session = self.shell.taking_requests(what)
        master = session.master
        if master is None:  # not yet opened (it takes requests only once it is)
            raise self.shell.refusal(what)
        if replicated and session.source is not None:
            session.source.check_insync(what)  # too few slaves in sync: refused before anything changes
        with session.requests.serving():
            await session.mastership.confirm()  # woken from a freeze: still master?
            return await handler(master)(request)

    async def _send(self, request: Request) -> dict[str, Any]:
        answer: dict[str, Any] = await self._serve("SEND", lambda master: master.send_handler.handle, request)
        return answer

    async def _pull(self, request: Request) -> tuple[dict[str, Any], bytes]:
        answer: tuple[dict[str, Any], bytes] = await self._serve(
            "PULL", lambda master: master.pull_handler.handle, request
        )
        return answer

    async def _ack(self, request: Request) -> dict[str, Any]:
        answer: dict[str, Any] = await self._serve("ACK", lambda master: master.ack_handler.ack, request)
        return answer

    async def _nack(self, request: Request) -> dict[str, Any]:
        answer: dict[str, Any] = await self._serve("NACK", lambda master: master.ack_handler.nack, request)
        return answer

    async def _heartbeat(self, request: Request) -> dict[str, Any]:
        answer: dict[str, Any] = await self._serve(
            "CONSUMER_HEARTBEAT", lambda master: master.ack_handler.heartbeat, request, replicated=False
        )
        return answer

    async def _status(self, request: Request) -> dict[str, Any]:
        if request.metadata:
            key = next(iter(request.metadata))
            raise RemoteProtocolError(
                f"STATUS: unknown field {key!r} (STATUS takes none)", code="bad_request", field=key
            )
        master = self.master
        fences = (
            master.fences.table()
            if master is not None
            else await self.member.run_blocking(partial(load_fences, self.member.storage.store))
        )
        return {
            "group": self.group,
            "address": self.address,
            "now_ms": self._clock.now_ms(),
            "fences": dict(sorted(fences.items())),
            "statistics": self.statistics().to_wire(),
        }

    # --------------------------------------------------------------- roles

    async def _session_ended(self, ended: MasterSession | SlaveSession | None) -> None:
        if isinstance(ended, MasterSession):
            log.warning("realtime %s: no longer master of epoch %d", self.group, ended.epoch)
        if isinstance(ended, SlaveSession):
            self._cut += ended.cut


# ------------------------------------------------------------------- opening


@asynccontextmanager
async def open_realtime_server(
    *,
    data_dir: str | Path,
    clock: Clock,
    listen: str | None = "127.0.0.1:0",
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
    replication: str = "sync",
    min_insync: int = 0,
    replication_timeout_ms: int = DEFAULT_REPLICATION_TIMEOUT_MS,
    peers: AsyncCaller | None = None,
    max_subjects: int = DEFAULT_MAX_SUBJECTS,
    max_groups: int = DEFAULT_MAX_GROUPS,
) -> AsyncIterator[RealtimeServer]:
    """Open the data folder, serve on ``listen`` until the block ends.

    ``flush="sync"`` answers a SEND once its records are fsynced; ``"async"``
    once written (fsync every ``DEFAULT_FLUSH_INTERVAL_MS``, 20 ms: a crash may lose the last moments).
    ``meta_address`` (one or several) makes the server a member of its group: it
    registers as ``advertise_address`` (default: the bound address,
    ``server.address``) and the metaserver names it master or slave;
    ``server.registration`` then holds the metaserver's latest word. Under
    ``replication="sync"`` a master answers a SEND, a PULL's hand-outs and an ACK
    once ``min_insync`` in-sync slaves hold them (``unavailable`` after
    ``replication_timeout_ms``); ``"async"`` does not wait for slaves.
    ``run_blocking`` runs the disk work (default: a worker thread; ``run_inline``
    for autojump tests); ``listen=None`` opens no listener (connections go to
    ``serve_stream``) and ``peers`` replaces the connections to other servers.
    ``max_subjects`` and ``max_groups`` cap what SENDs and PULLs may create (``realtime.caps``).
    """
    settings = MasterSettings(
        dedup_window_ms=dedup_window_ms,
        dedup_memory_ids=dedup_memory_ids,
        ack_timeout_ms=ack_timeout_ms,
        consumer_timeout_ms=consumer_timeout_ms,
        checkpoint_interval_ms=checkpoint_interval_ms,
        replication_timeout_ms=replication_timeout_ms,
        max_subjects=max_subjects,
        max_groups=max_groups,
    )
    _check_options(settings, limits=limits, replication=replication, min_insync=min_insync)
    bind = _bind_address(listen, meta_address=meta_address, advertise_address=advertise_address)
    root = Path(data_dir)
    async with _open_member(
        root,
        group=group,
        advertise_address=advertise_address,
        clock=clock,
        limits=limits,
        settings=settings,
        segment_size=segment_size,
        run_blocking=run_blocking,
        replication=replication,
        min_insync=min_insync,
        peers=peers,
        meta_address=meta_address,
    ) as (member, member_id):
        server = RealtimeServer(member, managed=meta_address is not None, limits=limits)
        async with _serving(server, bind, advertise_address, flush, meta_address, member_id) as address:
            log.info("realtime server %s serving on %s (data %s)", group, address or "-", root)
            yield server


def _check_options(settings: MasterSettings, *, limits: Limits, replication: str, min_insync: int) -> None:
    """Refuse options a server cannot run with, before anything opens."""
    check_cap("max_subjects", settings.max_subjects)
    check_cap("max_groups", settings.max_groups)
    check_max_record(limits.max_record)
    if settings.checkpoint_interval_ms <= 0:
        raise ValueError(f"checkpoint_interval_ms must be positive, got {settings.checkpoint_interval_ms}")
    if replication not in ("sync", "async"):
        raise ValueError(f"replication must be 'sync' or 'async', got {replication!r}")
    if min_insync < 0:
        raise ValueError(f"min_insync must be >= 0, got {min_insync}")
    if settings.replication_timeout_ms <= 0:
        raise ValueError(f"replication_timeout_ms must be positive, got {settings.replication_timeout_ms}")
    ack_timeout_ms, consumer_timeout_ms = settings.ack_timeout_ms, settings.consumer_timeout_ms
    if ack_timeout_ms <= 0 or consumer_timeout_ms <= 0:
        raise ValueError(
            f"ack_timeout_ms ({ack_timeout_ms}) and consumer_timeout_ms ({consumer_timeout_ms}) must be positive"
        )


def _bind_address(
    listen: str | None, *, meta_address: str | Sequence[str] | None, advertise_address: str | None
) -> tuple[str, int] | None:
    """Where to listen (None: no listener; connections go to ``serve_stream``)."""
    if listen is None:
        if meta_address is not None and advertise_address is None:
            raise ValueError("listen=None with a meta_address needs an advertise_address to register")
        return None
    return split_listen(listen)


@asynccontextmanager
async def _open_member(
    root: Path,
    *,
    group: str,
    advertise_address: str | None,
    clock: Clock,
    limits: Limits,
    settings: MasterSettings,
    segment_size: int,
    run_blocking: RunBlocking,
    replication: str,
    min_insync: int,
    peers: AsyncCaller | None,
    meta_address: str | Sequence[str] | None,
) -> AsyncIterator[tuple[Member, str]]:
    """Open the data folder ``root`` and what a member of ``group`` shares across its roles;
    yields the member and its id (``member_identity``). Closes the folder as the block ends."""
    async with open_blocking(
        partial(open_storage, root, segment_size=segment_size),
        lambda storage: storage.close(),
        run_blocking=run_blocking,
    ) as storage:
        history, member_id = await run_blocking(partial(member_identity, root, storage.store))
        async with _open_peers(peers, limits=limits, managed=meta_address is not None) as member_peers:
            member = Member(
                group=group,
                address=advertise_address or "",
                clock=clock,
                limits=limits,
                storage=storage,
                history=history,
                settings=settings,
                run_blocking=run_blocking,
                peers=member_peers,
                registration=None,
                mode=replication,
                min_insync=min_insync,
            )
            yield member, member_id


@asynccontextmanager
async def _open_peers(peers: AsyncCaller | None, *, limits: Limits, managed: bool) -> AsyncIterator[AsyncCaller | None]:
    """``peers``, or (a managed member given none) connections of its own for as long as the block runs."""
    if peers is not None or not managed:
        yield peers
        return
    # Registration and replication FETCH pace their own retries: no redial wait of the
    # transport's stacked under them (after a restart they would come back late).
    async with open_peers(limits=limits, **CLIENT_PEERS_OPTIONS) as own:
        yield own


@asynccontextmanager
async def _serving(
    server: RealtimeServer,
    bind: tuple[str, int] | None,
    advertise_address: str | None,
    flush: FlushPolicy,
    meta_address: str | Sequence[str] | None,
    member_id: str,
) -> AsyncIterator[str]:
    """Run ``server`` (its log writer, listener, registration and role loop); yields its address."""
    member = server.member
    storage, clock, limits = member.storage, member.clock, member.limits

    async def register(nursery: trio.Nursery, address: str) -> None:
        """Retries go to a scheduler the metaserver routes to; the member registers with it."""
        assert meta_address is not None
        member.address = address
        server.scheduler_routes = RouteClient(Peers(nursery, limits=limits), meta_addresses(meta_address), clock=clock)
        await server.shell.register(nursery, address, meta_address=meta_address, member_id=member_id)

    # The crash scope holds the writer too: nothing more is written on the way out.
    with server.shell.crash_scope():
        async with open_log_writer(storage.message_log, flush=flush, run_blocking=member.run_blocking) as writer:
            member.writer = writer
            async with serve_frames(
                server.frame_server,
                bind=bind,
                advertise_address=advertise_address,
                tasks=[server.shell.run_roles] if meta_address is None else [],
                register=register if meta_address is not None else None,
            ) as address:
                member.address = address
                yield address


__all__ = ["DEFAULT_REPLICATION_TIMEOUT_MS", "RealtimeServer", "RealtimeStatistics", "open_realtime_server"]
