"""ReplicatedServer: the shell every replicated server (scheduler, realtime) runs its sessions in.

A replicated member is master or slave of its group as the metaserver says; the shell
holds what is the same for every server kind:

- the role loop (``roles.RoleLoop``) over the kind's master and slave sessions, the role
  (``roles.Role``) and epoch the member reports, and the ``not_master`` refusal of a
  request only a master takes (``taking_requests``);
- FETCH (``serve_fetch``): a slave of the group fetches the master's log from the
  session's ``source.ReplicationSource``;
- registration with the metaserver (``register``), and the ``replica`` field of each
  heartbeat (``replica_info``);
- the replication statistics (``statistics.ReplicationStatistics``);
- the crash scope (``crash_scope``, ``crash``: the test hook for a kill);
- the waits of a role change: between two sessions the writes the old one queued land
  first; a graceful handover drains the master's requests (``InFlight``) and its
  writes, then waits until the target holds everything (``finish_handover``).

What differs between the kinds comes in as constructor arguments: how to make a
master or slave session (both satisfy ``MasterRole`` / ``SlaveRole``), whether the
member may lead an epoch at all, what to do when a session ends, the kind's name.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar

import trio

from delaymq.client.membership import MembershipView
from delaymq.client.registration import Registration, start_registration
from delaymq.clock import Clock
from delaymq.net.auth import require_server
from delaymq.net.peers import AsyncCaller
from delaymq.net.requests import Request
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import ServerKind
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.fetcher import ReplicaFetcher
from delaymq.replication.roles import Handover, NotMaster, Role, RoleLoop
from delaymq.replication.source import ReplicationSource
from delaymq.replication.statistics import (
    CutCounts,
    MasterReplication,
    ReplicationStatistics,
    SlaveReplication,
    TickLag,
)
from delaymq.replication.wire import FetchRequest
from delaymq.storage.log import SegmentedLog
from delaymq.storage.writer import LogWriter

log = logging.getLogger(__name__)

#: What a refusal says of a master session that does not take requests (starting, handing over).
NOT_ACCEPTING = "is not master now (waiting for the metaserver's word)"


class ReplicaMember(Protocol):
    """What the shell reads of a member (both kinds' ``Member`` dataclasses have these fields).

    ``address`` is known once bound, ``registration`` once registered, ``writer`` once
    the log writer is open: read whenever needed, never kept."""

    group: str
    address: str
    clock: Clock
    history: EpochHistory
    peers: AsyncCaller | None
    registration: Registration | None
    mode: str  # "sync" | "async"
    min_insync: int
    writer: LogWriter | None


class MasterRole(Protocol):
    """What the shell reads of a master session."""

    @property
    def epoch(self) -> int: ...

    @property
    def accepting(self) -> bool:
        """True while it takes requests (not while it takes over, hands over or was fenced)."""

    @property
    def source(self) -> ReplicationSource | None:
        """What serves FETCH (None: a standalone master, with no group to replicate to)."""

    @property
    def handover(self) -> Handover: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


class SlaveRole(Protocol):
    """What the shell reads of a slave session."""

    @property
    def epoch(self) -> int: ...

    @property
    def master_address(self) -> str:
        """The address of the master it fetches from."""

    @property
    def fetcher(self) -> ReplicaFetcher: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = ...) -> None: ...


M = TypeVar("M", bound=MasterRole)
S = TypeVar("S", bound=SlaveRole)


class ReplicatedServer(Generic[M, S]):
    """The shell of one replicated member (see the module docstring).

    ``make_master(epoch)`` and ``make_slave(master, epoch)`` make the kind's sessions
    (``master_type`` and ``slave_type`` tell them apart); ``make_master(0)`` is the
    session of a member without a metaserver. ``may_lead(epoch)`` false: the member
    waits rather than lead that epoch (a scheduler fenced by a newer one).
    ``session_ended(ended)`` runs after a session ends, before the next one starts.
    ``name`` is how refusals name the member ("realtime server"); ``not_accepting``
    what they say of a master session that does not take requests.
    """

    def __init__(
        self,
        member: ReplicaMember,
        *,
        kind: ServerKind,
        name: str,
        log: SegmentedLog,
        master_type: type[M],
        slave_type: type[S],
        make_master: Callable[[int], M],
        make_slave: Callable[[str, int], S],
        session_ended: Callable[[M | S | None], Awaitable[None]],
        may_lead: Callable[[int], bool] = lambda epoch: True,
        not_accepting: str = NOT_ACCEPTING,
    ) -> None:
        self.member = member
        self.kind = kind
        self.name = name
        self._log = log
        self._master_type = master_type
        self._slave_type = slave_type
        self._make_master = make_master
        self._make_slave = make_slave
        self._session_ended = session_ended
        self._may_lead = may_lead
        self._not_accepting = not_accepting
        self.crashed = False
        self._life: trio.CancelScope | None = None
        self.roles: RoleLoop[M | S] = RoleLoop(
            session_for=self._session_for, standalone=lambda: make_master(0), between=self._between
        )

    # --------------------------------------------------------------- role and epoch

    @property
    def session(self) -> M | S | None:
        return self.roles.session

    @property
    def master_session(self) -> M | None:
        """The session while this member is master (taking requests or not)."""
        session = self.roles.session
        return session if isinstance(session, self._master_type) else None

    @property
    def slave_session(self) -> S | None:
        session = self.roles.session
        return session if isinstance(session, self._slave_type) else None

    @property
    def role(self) -> Role:
        """What the member does now (``Role``: master only while it takes requests)."""
        master = self.master_session
        if master is not None:
            return Role.MASTER if master.accepting else Role.WAITING
        return Role.SLAVE if self.slave_session is not None else Role.WAITING

    @property
    def epoch(self) -> int:
        session = self.roles.session
        return session.epoch if session is not None else 0

    def taking_requests(self, what: str) -> M:
        """The master session, if it takes requests now; else ``what`` is refused (``not_master``)."""
        master = self.master_session
        if master is not None and master.accepting:
            stranded = master.source.stranded() if master.source is not None else None
            if stranded is None:
                return master
            member = self.member
            raise NotMaster(
                f"{what}: {self.name} {member.address or '-'} of group {member.group} is not taking requests: "
                f"{stranded}; ask the metaserver"
            )
        raise self.refusal(what)

    def refusal(self, what: str) -> NotMaster:
        """The ``not_master`` answer to ``what``, saying what this member is instead."""
        slave = self.slave_session
        if self.master_session is not None:
            state = self._not_accepting
        elif slave is not None:
            state = f"is a slave (its master is {slave.master_address})"
        else:
            state = NOT_ACCEPTING
        member = self.member
        return NotMaster(
            f"{what}: {self.name} {member.address or '-'} of group {member.group} {state}; ask the metaserver"
        )

    # --------------------------------------------------------------- sessions

    async def run_roles(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The role loop: a task of the server's (started once registered, or at once standalone)."""
        await self.roles.run(self.member.registration, task_status=task_status)

    def _session_for(self, view: MembershipView) -> M | S | None:
        if view.role == "master":  # the metaserver's word (``MembershipView``), not a ``Role``
            return self._make_master(view.epoch) if self._may_lead(view.epoch) else None
        if view.role == "slave" and view.master_address and view.master_address != self.member.address:
            slave = self._make_slave(view.master_address, view.epoch)
            registration, clock = self.member.registration, self.member.clock
            if registration is not None:  # its master may be dead: hear of a promotion at once
                slave.fetcher.on_failed = lambda: registration.hurry(clock.monotonic_ms())
            return slave
        return None

    async def _between(self, ended: M | S | None) -> None:
        await self._session_ended(ended)
        writer = self.member.writer  # writes queued by the old master land before a fetcher appends
        if writer is not None:
            await writer.wait_idle()

    async def register(
        self, nursery: trio.Nursery, address: str, *, meta_address: str | Sequence[str], member_id: str
    ) -> None:
        """Register with the metaserver as ``address`` (heartbeats in ``nursery``), then start the role loop."""
        member = self.member
        assert member.peers is not None
        member.address = address
        member.registration = await start_registration(
            nursery,
            member.peers,
            group=member.group,
            kind=self.kind,
            address=address,
            meta_address=meta_address,
            clock=member.clock,
            member=member_id,
            replica=self.replica_info,
        )
        await nursery.start(self.run_roles)

    # --------------------------------------------------------------- crash

    @contextmanager
    def crash_scope(self) -> Iterator[None]:
        """The scope ``crash`` cancels: the server's whole life, its log writer included."""
        with trio.CancelScope() as life:
            self._life = life
            yield

    def crash(self) -> None:
        """Test hook: stop now, as a killed process would (every task cancelled where it waits)."""
        self.crashed = True
        if self._life is not None:
            self._life.cancel()

    # --------------------------------------------------------------- FETCH and reports

    async def serve_fetch(self, request: Request) -> tuple[dict[str, Any], bytes]:
        """FETCH: the master's log for a slave of this group."""
        member = self.member
        # Before anything else: the answer holds this group's whole log, and the fetcher's
        # offset holds back its deletion (``ReplicationSource.retain_from``).
        require_server(request.identity, "FETCH", self.kind, member.group)
        fetch = FetchRequest.from_metadata(request.metadata)
        master = self.master_session
        if master is None or master.source is None:
            raise NotMaster(f"FETCH: {self.name} {member.address or '-'} of group {member.group} is not master now")
        if fetch.group != member.group:
            raise RemoteProtocolError(
                f"FETCH for group {fetch.group!r} at a member of group {member.group!r}",
                code="bad_request",
                field="group",
            )
        answer, body = await master.source.serve_fetch(fetch)
        return answer.as_metadata(), body

    def replica_info(self) -> dict[str, Any]:
        """The ``replica`` field of each heartbeat (metaserver contract)."""
        info: dict[str, Any] = {"offset": self._log.flushed_offset, "epoch": self.epoch, "mode": self.member.mode}
        master = self.master_session
        if master is not None and master.source is not None:
            info["in_sync"] = master.source.in_sync()
            if master.handover.handed_over is not None:
                info["handed_over"] = master.handover.handed_over
        return info

    def replication_statistics(
        self, *, cut: CutCounts, applied_offset: int | None = None, tick: TickLag | None = None
    ) -> ReplicationStatistics:
        """The member's replication state; ``cut``, ``applied_offset`` and ``tick`` are the kind's own."""
        member = self.member
        durable = self._log.flushed_offset
        master_part = slave_part = None
        master = self.master_session
        if master is not None and master.source is not None:
            source = master.source.statistics()
            master_part = MasterReplication(
                source.high_watermark, source.replicas, master.accepting, source.recorded_in_sync
            )
        slave = self.slave_session
        if slave is not None:
            fetched = slave.fetcher.statistics()
            slave_part = SlaveReplication(
                master_durable_end=fetched.master_durable_end,
                lag_bytes=max(0, fetched.master_durable_end - durable),
                fetches=fetched.fetches,
                fetch_failures=fetched.failures,
                tick=tick,
                applied_offset=applied_offset,
            )
        return ReplicationStatistics(
            mode=member.mode,
            min_insync=member.min_insync,
            durable_end=durable,
            history=member.history.entries,
            cut=cut,
            master=master_part,
            slave=slave_part,
        )


class InFlight:
    """The requests a master session is serving: a handover lets them end before its last writes."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = trio.Event()
        self._idle.set()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Count one request for the block."""
        self.count += 1
        if self.count == 1:
            self._idle = trio.Event()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Return once the requests being served now have ended."""
        await self._idle.wait()


async def finish_handover(writer: LogWriter, source: ReplicationSource, target: str) -> None:
    """A graceful handover's end, once the master takes no more requests: what it accepted
    is written and durable, goes out to the slaves now, and ``target`` holds all of it."""
    await writer.wait_durable()
    source.poke()  # the last records (and tick) go out now, not at the next tick interval
    await source.wait_holds_all(target)


__all__ = [
    "NOT_ACCEPTING",
    "InFlight",
    "MasterRole",
    "ReplicaMember",
    "ReplicatedServer",
    "SlaveRole",
    "finish_handover",
]
