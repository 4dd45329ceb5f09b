"""The metaserver: the sans-IO ``Registry`` served over the network and kept in lmdb.

Every request is handled on the trio thread against the one registry, with the
time read at arrival: the registry's *steady* time, the wall clock at start plus
the monotonic time since, so a wall-clock step neither evicts every server (a
step forward) nor keeps dead ones routed (a step back). A change worth keeping (a new server, a
role or state change) is written as one registry snapshot to the data folder's
lmdb store before the request is answered, so what an admin was told is what a
restarted metaserver knows; concurrent changes share one write. On start the
snapshot is restored, so a restarted metaserver answers routes at once (every
server gets a fresh eviction grace). A periodic task notices evictions and logs
groups that lose or regain their master; it wakes in time for the next
failover of a managed group too, and a promotion is written before anyone is
told of it (its new epoch must survive a restart of the metaserver).

Wire metadata (msgpack maps) of each command:

- ``REGISTER {group, kind, role, address, version, incarnation?, member?,
  replica?}`` and ``HEARTBEAT {group, address, replica?}`` answer ``{state,
  master, route_version, heartbeat_interval_ms}``; a heartbeat from a server this
  metaserver does not know is refused with code ``register_first``; one from a
  master another server has superseded (the newest registration of a group's
  master wins), and its registrations as master with the same ``incarnation``,
  with code ``superseded``. With a tokens file, a REGISTER is checked against the
  token's ``servers`` by the transport, and a HEARTBEAT here, as the kind of its
  group (``forbidden``, field ``servers``, before anything is looked up or
  changed). A REGISTER whose ``member`` is live at another address under another
  ``incarnation`` is refused with code ``member_taken`` (the id is no secret: it
  stays with the run that registered it until that one is evicted). Servers of a
  managed group (they send ``replica``: ``{offset, epoch, mode?, in_sync?,
  handed_over?}``) are never superseded: the answer adds ``role`` and ``epoch``
  (and ``handover_to`` to the master while a handover is pending), and the
  metaserver decides who is master.
- ``HANDOVER {group, to?}`` asks a managed group's master to hand over to ``to``
  (default: its best in-sync slave); answers ``{group, epoch, from, to}``.
- ``ROUTE {route, subject?, known_version?}`` answers ``{version, groups: [{group,
  kind, state, address, slaves}]}``, or ``{version, unchanged: true}`` when
  ``known_version`` is the current version.
- ``SET_STATE {group, state}`` answers ``{state, previous}``.
- ``STATUS {}`` answers ``{now_ms, route_version, evict_after_ms,
  heartbeat_interval_ms, failover_after_ms, rows: [{group, kind, role, address,
  state, version, seconds_since_heartbeat, evicted, is_master, epoch, member,
  offset, in_sync}]}``.
- ``PING {}`` answers ``{now_ms}``.

Refusals are ``bad_request`` errors naming the field (``register_first``,
``superseded``, ``member_taken`` and ``forbidden`` aside). SET_STATE and HANDOVER
are logged with the name of the token that asked (both are admin only).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from delaymq.clock import Clock
from delaymq.metaserver.registry import (
    DEFAULT_EVICT_AFTER_MS,
    DEFAULT_FAILOVER_AFTER_MS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    MEMBER_TAKEN,
    FailoverBlocked,
    HandoverDropped,
    HeartbeatReply,
    MasterChanged,
    MemberTaken,
    Registry,
    RegistryError,
    RegistryStatistics,
    ReplicaReport,
    ServerInfo,
    StatusRow,
    Superseded,
    check_address,
    check_group_name,
)
from delaymq.net.addresses import split_listen
from delaymq.net.auth import require_server
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.requests import Handler, Request
from delaymq.net.server import FrameServer, ServerStatistics
from delaymq.net.serving import serve_frames
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.routes import REGISTER_FIRST, SUPERSEDED
from delaymq.storage.state import StateStore, pack, unpack
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread

log = logging.getLogger(__name__)

#: Where the registry snapshot lives in the data folder's state store.
SNAPSHOT_DB = "metaserver"
SNAPSHOT_KEY = b"registry"

# The wire names of the fields whose registry names differ.
_WIRE_FIELDS = {"software_version": "version"}


@contextmanager
def _refusals(command: str) -> Iterator[None]:
    """Turn a ``RegistryError`` into the ``bad_request`` answer naming its field."""
    try:
        yield
    except Superseded as error:
        raise RemoteProtocolError(f"{command}: {error.args[0]}", code=SUPERSEDED, field=error.field) from None
    except MemberTaken as error:
        message = str(error).split(": ", 1)[-1]
        raise RemoteProtocolError(f"{command}: {message}", code=MEMBER_TAKEN, field=error.field) from None
    except RegistryError as error:
        field = _WIRE_FIELDS.get(error.field, error.field)
        message = str(error).split(": ", 1)[-1]
        raise RemoteProtocolError(f"{command}: {field}: {message}", code="bad_request", field=field) from None


def _field(command: str, metadata: Mapping[str, Any], name: str, kind: type, *, required: bool = True) -> Any:
    """One metadata field, present and of the right type (None if optional and absent)."""
    value = metadata.get(name)
    if value is None:
        if required:
            raise RemoteProtocolError(f"{command}: field {name!r} is missing", code="bad_request", field=name)
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RemoteProtocolError(
            f"{command}: field {name!r} must be {kind.__name__}, got {type(value).__name__}",
            code="bad_request",
            field=name,
        )
    return value


def _asker(request: Request) -> str:
    """Who sent an admin request, for the log: its token's name (with a tokens file) and address."""
    if request.identity is None:
        return request.peer
    return f"{request.identity.name!r} from {request.peer}"


def _reply(reply: HeartbeatReply) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "state": reply.state.value,
        "master": reply.master,
        "route_version": reply.route_version,
        "heartbeat_interval_ms": reply.heartbeat_interval_ms,
    }
    if reply.role is not None:  # a managed group
        answer["role"] = reply.role.value
        answer["epoch"] = reply.epoch
        if reply.handover_to is not None:
            answer["handover_to"] = reply.handover_to
    return answer


def _row(row: StatusRow) -> dict[str, Any]:
    return {
        "group": row.group,
        "kind": row.kind.value,
        "role": row.role.value,
        "address": row.address,
        "state": row.state.value,
        "version": row.software_version,
        "seconds_since_heartbeat": row.seconds_since_heartbeat,
        "evicted": row.evicted,
        "is_master": row.is_master,
        "epoch": row.epoch,
        "member": row.member,
        "offset": row.offset,
        "in_sync": row.in_sync,
    }


@dataclass(frozen=True, slots=True)
class MetaserverStatistics:
    address: str | None
    registry: RegistryStatistics
    transport: ServerStatistics
    snapshots_written: int
    restored_servers: int


class Metaserver:
    """The registry behind the handlers of one metaserver. Build with ``open_metaserver``."""

    def __init__(
        self,
        registry: Registry,
        store: StateStore,
        clock: Clock,
        *,
        evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
        limits: Limits = DEFAULT_LIMITS,
        run_blocking: RunBlocking = run_in_thread,
        check_interval_ms: int = 1_000,
    ) -> None:
        """``evict_after_ms``, ``heartbeat_interval_ms`` and ``failover_after_ms`` are the
        registry's own, for STATUS."""
        self.registry = registry
        self.evict_after_ms = evict_after_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.failover_after_ms = failover_after_ms
        self.address: str | None = None
        self._store = store
        self._clock = clock
        self._run_blocking = run_blocking
        self._check_interval_ms = check_interval_ms
        # The registry's steady time: the wall clock at start, then monotonic.
        self._steady_origin = clock.now_ms() - clock.monotonic_ms()
        self._persist_lock = trio.Lock()
        # The expiry task's sleep, cancelled when a failover falls due before it ends.
        self._expiry_sleep: trio.CancelScope | None = None
        self._expiry_wake_ms = 0
        self._snapshots_written = 0
        rows = registry.status(self.steady_ms())
        self._restored = len(rows)
        self._known = {(row.group, row.address) for row in rows}
        self._masters = _live_masters(rows)
        self._seen_version = registry.version
        self.server = FrameServer(self.handlers(), limits=limits)

    def steady_ms(self) -> int:
        """The registry's time: epoch ms at start, moved on by the monotonic clock only."""
        return self._steady_origin + self._clock.monotonic_ms()

    def handlers(self) -> dict[int, Handler]:
        return {
            Command.PING: self._ping,
            Command.REGISTER: self._register,
            Command.HEARTBEAT: self._heartbeat,
            Command.ROUTE: self._route,
            Command.SET_STATE: self._set_state,
            Command.STATUS: self._status,
            Command.HANDOVER: self._handover,
        }

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (a socket, or an in-memory stream in tests)."""
        await self.server.serve_stream(stream)

    def statistics(self) -> MetaserverStatistics:
        return MetaserverStatistics(
            address=self.address,
            registry=self.registry.statistics(),
            transport=self.server.statistics(),
            snapshots_written=self._snapshots_written,
            restored_servers=self._restored,
        )

    # -- handlers -------------------------------------------------------------

    async def _ping(self, request: Request) -> dict[str, Any]:
        return {"now_ms": self._clock.now_ms()}

    async def _register(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group, kind, role, address, version = (
            _field("REGISTER", md, name, str) for name in ("group", "kind", "role", "address", "version")
        )
        incarnation = _field("REGISTER", md, "incarnation", str, required=False)
        member = _field("REGISTER", md, "member", str, required=False)
        replica = md.get("replica")
        now = self.steady_ms()
        changes = self.registry.changes
        deposed_before = self.registry.superseded(group)
        with _refusals("REGISTER"):
            report = None if replica is None else ReplicaReport.from_dict(replica)
            info = ServerInfo(
                group, kind, role, address, version, incarnation=incarnation, member=member, replica=report
            )
            try:
                reply = self.registry.register(info, now_ms=now)
            except MemberTaken as error:
                log.warning(
                    "refused REGISTER of %s in group %s (%s): member %s is live at %s",
                    address,
                    group,
                    _asker(request),
                    error.member,
                    error.address,
                )
                raise
        if (group, address) not in self._known:
            self._known.add((group, address))
            assigned = role if reply.role is None else f"{reply.role} (epoch {reply.epoch})"
            log.info("server %s registered: %s of %s group %s (version %s)", address, assigned, kind, group, version)
        elif reply.role is None and self.registry.changes != changes:
            log.info("server %s of group %s now registers as %s (version %s)", address, group, role, version)
        for old, by in self.registry.superseded(group).items():
            if deposed_before.get(old) != by:
                self._known.discard((group, old))
                log.warning(
                    "server %s superseded %s as master of group %s: %s is dropped from routes at once, "
                    "and refused if it is still running",
                    by,
                    old,
                    group,
                    old,
                )
        await self.persist()
        self._notice(now)
        return _reply(reply)

    async def _heartbeat(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = _field("HEARTBEAT", md, "group", str)
        address = _field("HEARTBEAT", md, "address", str)
        with _refusals("HEARTBEAT"):
            check_group_name(group)
        kind = self.registry.kind_of(group)
        if kind is not None:  # an unknown group is told to register, which the transport checks
            require_server(request.identity, "HEARTBEAT", kind.value, group)
        with _refusals("HEARTBEAT"):
            check_address(address)
            replica = None if md.get("replica") is None else ReplicaReport.from_dict(md["replica"])
        now = self.steady_ms()
        try:
            reply = self.registry.heartbeat(group, address, now_ms=now, replica=replica)
        except Superseded as error:
            raise RemoteProtocolError(f"HEARTBEAT: {error.args[0]}", code=SUPERSEDED, field=error.field) from None
        except RegistryError as error:  # well-formed, so: not registered here
            raise RemoteProtocolError(
                f"HEARTBEAT: {error}; send REGISTER", code=REGISTER_FIRST, field=error.field
            ) from None
        await self.persist()  # a promotion (a handover completed) is written before it is told
        self._notice(now)
        return _reply(reply)

    async def _route(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        route = _field("ROUTE", md, "route", str)
        subject = _field("ROUTE", md, "subject", str, required=False)
        known = _field("ROUTE", md, "known_version", int, required=False)
        now = self.steady_ms()
        with _refusals("ROUTE"):
            answer = self.registry.route(route, now_ms=now, subject=subject)
        await self.persist()  # a failover noticed just now is written before routes show it
        self._notice(now)
        if known is not None and known == answer.version:
            return {"version": answer.version, "unchanged": True}
        return answer.as_dict()

    async def _set_state(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = _field("SET_STATE", md, "group", str)
        state = _field("SET_STATE", md, "state", str)
        now = self.steady_ms()
        with _refusals("SET_STATE"):
            check_group_name(group)
            previous = next((row.state for row in self.registry.status(now) if row.group == group), None)
            if previous is None:
                raise RegistryError("group", f"unknown group {group!r}")
            self.registry.set_state(group, state)
        current = next(row.state for row in self.registry.status(now) if row.group == group)
        if current is not previous:
            log.info("group %s state changed %s -> %s (asked by %s)", group, previous, current, _asker(request))
        await self.persist()
        self._notice(now)
        return {"state": current.value, "previous": previous.value}

    async def _status(self, request: Request) -> dict[str, Any]:
        now = self.steady_ms()
        rows = self.registry.status(now)
        await self.persist()
        self._notice(now)
        return {
            "now_ms": self._clock.now_ms(),
            "route_version": self.registry.version,
            "evict_after_ms": self.evict_after_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "failover_after_ms": self.failover_after_ms,
            "rows": [_row(row) for row in rows],
        }

    async def _handover(self, request: Request) -> dict[str, Any]:
        md = request.metadata
        group = _field("HANDOVER", md, "group", str)
        to = _field("HANDOVER", md, "to", str, required=False)
        now = self.steady_ms()
        with _refusals("HANDOVER"):
            handover = self.registry.handover(group, to, now_ms=now)
        log.info(
            "group %s: handover from master %s to %s asked by %s at epoch %d",
            group,
            handover.from_address,
            handover.to_address,
            _asker(request),
            handover.epoch,
        )
        await self.persist()
        self._notice(now)
        return {"group": group, "epoch": handover.epoch, "from": handover.from_address, "to": handover.to_address}

    # -- background work ------------------------------------------------------

    async def persist(self) -> None:
        """Write the registry snapshot if it changed; concurrent callers share one write."""
        if not self.registry.dirty:
            return
        async with self._persist_lock:
            if not self.registry.dirty:
                return  # the write we waited for covered our change
            changes = self.registry.changes
            data = pack(self.registry.snapshot())
            await self._run_blocking(partial(self._store.put, SNAPSHOT_DB, SNAPSHOT_KEY, data))
            self.registry.mark_persisted(changes)
            self._snapshots_written += 1

    async def run_expiry(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Notice evictions every ``check_interval_ms``, and failovers when due, so
        they happen, are written and are logged on time."""
        task_status.started()
        while True:
            now = self.steady_ms()
            wake = now + self._check_interval_ms
            deadline = self.registry.next_deadline_ms
            if deadline is not None:
                wake = min(wake, max(deadline, now))
            with trio.CancelScope() as sleep:
                self._expiry_sleep, self._expiry_wake_ms = sleep, wake
                await self._clock.sleep_ms(wake - now)
            self._expiry_sleep = None
            now = self.steady_ms()
            self.registry.expire(now)
            await self.persist()
            self._notice(now, always=True)

    def _wake_expiry(self) -> None:
        """Cut the expiry task's sleep short if a failover falls due before it ends."""
        if self._expiry_sleep is None:
            return
        deadline = self.registry.next_deadline_ms
        if deadline is not None and deadline < self._expiry_wake_ms:
            self._expiry_sleep.cancel()

    def _log_events(self) -> set[str]:
        """Log the registry's mastership events; the groups whose master they changed."""
        changed: set[str] = set()
        for event in self.registry.take_events():
            if isinstance(event, MasterChanged):
                changed.add(event.group)
                if event.reason == "failover" and event.old is None:
                    log.warning(
                        "group %s: its master left the group; promoted %s (offset %s) at epoch %d",
                        event.group,
                        event.new,
                        event.offset,
                        event.epoch,
                    )
                elif event.reason == "failover":
                    log.warning(
                        "group %s failed over: master %s silent for %.1f s; promoted %s (offset %s) at epoch %d",
                        event.group,
                        event.old,
                        event.silent_ms / 1000,
                        event.new,
                        event.offset,
                        event.epoch,
                    )
                elif event.reason == "handover":
                    log.info(
                        "group %s handed over from %s to %s (offset %s) at epoch %d",
                        event.group,
                        event.old,
                        event.new,
                        event.offset,
                        event.epoch,
                    )
                elif event.reason == "restart":
                    log.info(
                        "group %s: master %s restarted%s; epoch %d",
                        event.group,
                        event.new,
                        "" if event.old in (None, event.new) else f" (was at {event.old})",
                        event.epoch,
                    )
                else:
                    log.info("group %s: %s is master at epoch %d", event.group, event.new, event.epoch)
            elif isinstance(event, FailoverBlocked):
                log.warning(
                    "group %s: master %s silent for %.1f s, but no live in-sync slave may replace it "
                    "(in sync: %s); the group waits for its master",
                    event.group,
                    event.master,
                    event.silent_ms / 1000,
                    ", ".join(event.in_sync) or "none",
                )
            elif isinstance(event, HandoverDropped):
                log.warning("group %s: handover to %s dropped: %s", event.group, event.to_address, event.reason)
        return changed

    def _notice(self, now: int, *, always: bool = False) -> None:
        """Log mastership changes, and groups that lost or regained a live master since the last look."""
        logged = self._log_events()
        self._wake_expiry()
        if not always and self.registry.version == self._seen_version:
            return
        rows = self.registry.status(now)
        masters = _live_masters(rows)
        by_address = {(row.group, row.address): row for row in rows}
        for group, master in masters.items():
            before = self._masters.get(group, ...)
            if before is ... or before == master:
                continue  # a new group (its registration was logged) or no change
            if master is None:
                row = by_address.get((group, before)) if before else None
                if row is not None and row.evicted:
                    log.info(
                        "group %s evicted: no heartbeat from its master %s for %.1f s",
                        group,
                        before,
                        row.seconds_since_heartbeat,
                    )
                else:
                    log.info("group %s has no live master", group)
            elif before is None:
                if group not in logged:
                    log.info("group %s is back: its master %s heartbeats", group, master)
            elif group in logged:
                pass  # a promotion, logged with its epoch
            elif self.registry.superseded(group).get(before) != master:  # superseding was logged
                log.info("group %s master moved from %s to %s", group, before, master)
        self._masters = masters
        self._seen_version = self.registry.version


def _live_masters(rows: list[StatusRow]) -> dict[str, str | None]:
    """Each group's live master address, or None while it has none."""
    masters: dict[str, str | None] = {}
    for row in rows:
        masters.setdefault(row.group, None)
        if row.is_master and not row.evicted:
            masters[row.group] = row.address
    return masters


def _load(
    store: StateStore, now_ms: int, *, evict_after_ms: int, heartbeat_interval_ms: int, failover_after_ms: int
) -> tuple[Registry, int]:
    """The registry restored from the store's snapshot (or a new one), and the snapshot's size."""
    options = {
        "evict_after_ms": evict_after_ms,
        "heartbeat_interval_ms": heartbeat_interval_ms,
        "failover_after_ms": failover_after_ms,
    }
    data = store.get(SNAPSHOT_DB, SNAPSHOT_KEY)
    if data is None:
        return Registry(**options), 0
    try:
        snapshot = unpack(data)
        registry = Registry.restore(snapshot, now_ms, **options)
    except RegistryError as error:
        raise RegistryError(
            error.field, f"the registry snapshot in {store.directory} cannot be restored: {error}"
        ) from error
    except ValueError as error:  # msgpack's errors for bytes that are not msgpack
        raise RegistryError("snapshot", f"the registry snapshot in {store.directory} is unreadable: {error}") from error
    return registry, len(data)


def _log_restored(registry: Registry, data_dir: str | Path, size: int, evict_after_ms: int) -> None:
    stats = registry.statistics()
    log.info(
        "restored %d servers in %d groups from %s (%d bytes); each has %.1f s to heartbeat",
        stats.servers,
        stats.groups,
        data_dir,
        size,
        evict_after_ms / 1000,
    )


@asynccontextmanager
async def open_metaserver(
    *,
    listen: str | None = "127.0.0.1:0",
    data_dir: str | Path,
    clock: Clock,
    evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
    failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
    limits: Limits = DEFAULT_LIMITS,
    check_interval_ms: int | None = None,
    run_blocking: RunBlocking = run_in_thread,
) -> AsyncIterator[Metaserver]:
    """A running metaserver; ``.address`` is the bound "host:port".

    ``listen=None`` opens no listener: connections are handed to
    ``serve_stream`` (in-memory streams in tests). ``check_interval_ms`` is how
    often evictions are looked for (default: a tenth of ``evict_after_ms``, at
    most 1 s; failovers of managed groups, after ``failover_after_ms`` of their
    master's silence, are looked for when due). ``run_blocking`` runs the store's blocking calls (default: a worker
    thread; ``delaymq.storage.threads.run_inline`` for autojump tests). Raises
    ``RegistryError`` for a bad configuration or an unreadable snapshot,
    ``OSError`` when the address cannot be bound.
    """
    # Check the configuration before touching the data folder.
    Registry(
        evict_after_ms=evict_after_ms, heartbeat_interval_ms=heartbeat_interval_ms, failover_after_ms=failover_after_ms
    )
    bind = split_listen(listen) if listen is not None else None
    if check_interval_ms is None:
        check_interval_ms = max(1, min(1_000, evict_after_ms // 10))
    async with open_blocking(partial(StateStore.open, data_dir), StateStore.close, run_blocking=run_blocking) as store:
        registry, size = await run_blocking(
            partial(
                _load,
                store,
                clock.now_ms(),
                evict_after_ms=evict_after_ms,
                heartbeat_interval_ms=heartbeat_interval_ms,
                failover_after_ms=failover_after_ms,
            )
        )
        metaserver = Metaserver(
            registry,
            store,
            clock,
            evict_after_ms=evict_after_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            failover_after_ms=failover_after_ms,
            limits=limits,
            run_blocking=run_blocking,
            check_interval_ms=check_interval_ms,
        )
        if size:
            _log_restored(registry, data_dir, size, evict_after_ms)
        async with serve_frames(metaserver.server, bind=bind, tasks=[metaserver.run_expiry]) as address:
            metaserver.address = address or None  # None: no listener
            yield metaserver


__all__ = [
    "Metaserver",
    "MetaserverStatistics",
    "open_metaserver",
]
