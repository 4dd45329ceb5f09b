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
groups that lose or regain their master.

Wire metadata (msgpack maps) of each command:

- ``REGISTER {group, kind, role, address, version, incarnation?}`` and
  ``HEARTBEAT {group, address}`` answer ``{state, master, route_version,
  heartbeat_interval_ms}``; a heartbeat from a server this metaserver does not
  know is refused with code ``register_first``; one from a master another server
  has superseded (the newest registration of a group's master wins), and its
  registrations as master with the same ``incarnation``, with code ``superseded``.
- ``ROUTE {route, subject?, known_version?}`` answers ``{version, groups: [{group,
  kind, state, address, slaves}]}``, or ``{version, unchanged: true}`` when
  ``known_version`` is the current version.
- ``SET_STATE {group, state}`` answers ``{state, previous}``.
- ``STATUS {}`` answers ``{now_ms, route_version, evict_after_ms,
  heartbeat_interval_ms, rows: [{group, kind, role, address, state, version,
  seconds_since_heartbeat, evicted, is_master}]}``.
- ``PING {}`` answers ``{now_ms}``.

Refusals are ``bad_request`` errors naming the field (``register_first`` and
``superseded`` aside).
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

from delaymq.metaserver.registry import (
    DEFAULT_EVICT_AFTER_MS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    HeartbeatReply,
    Registry,
    RegistryError,
    RegistryStatistics,
    ServerInfo,
    StatusRow,
    Superseded,
    check_address,
    check_group_name,
)
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol.routes import REGISTER_FIRST, SUPERSEDED
from delaymq.protocol.serving import serve_frames
from delaymq.protocol.transport import FrameServer, Handler, Request, ServerStatistics, split_listen
from delaymq.storage.state import StateStore, pack, unpack
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread
from delaymq.wheel.clock import Clock

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


def _reply(reply: HeartbeatReply) -> dict[str, Any]:
    return {
        "state": reply.state.value,
        "master": reply.master,
        "route_version": reply.route_version,
        "heartbeat_interval_ms": reply.heartbeat_interval_ms,
    }


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
        limits: Limits = DEFAULT_LIMITS,
        run_blocking: RunBlocking = run_in_thread,
        check_interval_ms: int = 1_000,
    ) -> None:
        """``evict_after_ms`` and ``heartbeat_interval_ms`` are the registry's own, for STATUS."""
        self.registry = registry
        self.evict_after_ms = evict_after_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.address: str | None = None
        self._store = store
        self._clock = clock
        self._run_blocking = run_blocking
        self._check_interval_ms = check_interval_ms
        # The registry's steady time: the wall clock at start, then monotonic.
        self._steady_origin = clock.now_ms() - clock.monotonic_ms()
        self._persist_lock = trio.Lock()
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
        now = self.steady_ms()
        changes = self.registry.changes
        deposed_before = self.registry.superseded(group)
        with _refusals("REGISTER"):
            reply = self.registry.register(
                ServerInfo(group, kind, role, address, version, incarnation=incarnation), now_ms=now
            )
        if (group, address) not in self._known:
            self._known.add((group, address))
            log.info("server %s registered: %s of %s group %s (version %s)", address, role, kind, group, version)
        elif self.registry.changes != changes:
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
            check_address(address)
        now = self.steady_ms()
        try:
            reply = self.registry.heartbeat(group, address, now_ms=now)
        except Superseded as error:
            raise RemoteProtocolError(f"HEARTBEAT: {error.args[0]}", code=SUPERSEDED, field=error.field) from None
        except RegistryError as error:  # well-formed, so: not registered here
            raise RemoteProtocolError(
                f"HEARTBEAT: {error}; send REGISTER", code=REGISTER_FIRST, field=error.field
            ) from None
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
            log.info("group %s state changed %s -> %s (asked by %s)", group, previous, current, request.peer)
        await self.persist()
        self._notice(now)
        return {"state": current.value, "previous": previous.value}

    async def _status(self, request: Request) -> dict[str, Any]:
        now = self.steady_ms()
        rows = self.registry.status(now)
        self._notice(now)
        return {
            "now_ms": self._clock.now_ms(),
            "route_version": self.registry.version,
            "evict_after_ms": self.evict_after_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "rows": [_row(row) for row in rows],
        }

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
        """Notice evictions every ``check_interval_ms``, so they are logged when due."""
        task_status.started()
        while True:
            await self._clock.sleep_ms(self._check_interval_ms)
            now = self.steady_ms()
            self.registry.expire(now)
            self._notice(now, always=True)

    def _notice(self, now: int, *, always: bool = False) -> None:
        """Log groups that lost or regained a live master since the last look."""
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
                log.info("group %s is back: its master %s heartbeats", group, master)
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


def _load(store: StateStore, now_ms: int, *, evict_after_ms: int, heartbeat_interval_ms: int) -> tuple[Registry, int]:
    """The registry restored from the store's snapshot (or a new one), and the snapshot's size."""
    data = store.get(SNAPSHOT_DB, SNAPSHOT_KEY)
    if data is None:
        return Registry(evict_after_ms=evict_after_ms, heartbeat_interval_ms=heartbeat_interval_ms), 0
    try:
        snapshot = unpack(data)
        registry = Registry.restore(
            snapshot, now_ms, evict_after_ms=evict_after_ms, heartbeat_interval_ms=heartbeat_interval_ms
        )
    except RegistryError as error:
        raise RegistryError(
            error.field, f"the registry snapshot in {store.directory} cannot be restored: {error}"
        ) from error
    except ValueError as error:  # msgpack's errors for bytes that are not msgpack
        raise RegistryError("snapshot", f"the registry snapshot in {store.directory} is unreadable: {error}") from error
    return registry, len(data)


@asynccontextmanager
async def open_metaserver(
    *,
    listen: str | None = "127.0.0.1:0",
    data_dir: str | Path,
    clock: Clock,
    evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
    limits: Limits = DEFAULT_LIMITS,
    check_interval_ms: int | None = None,
    run_blocking: RunBlocking = run_in_thread,
) -> AsyncIterator[Metaserver]:
    """A running metaserver; ``.address`` is the bound "host:port".

    ``listen=None`` opens no listener: connections are handed to
    ``serve_stream`` (in-memory streams in tests). ``check_interval_ms`` is how
    often evictions are looked for (default: a tenth of ``evict_after_ms``, at
    most 1 s). ``run_blocking`` runs the store's blocking calls (default: a worker
    thread; ``delaymq.storage.threads.run_inline`` for autojump tests). Raises
    ``RegistryError`` for a bad configuration or an unreadable snapshot,
    ``OSError`` when the address cannot be bound.
    """
    # Check the configuration before touching the data folder.
    Registry(evict_after_ms=evict_after_ms, heartbeat_interval_ms=heartbeat_interval_ms)
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
            )
        )
        metaserver = Metaserver(
            registry,
            store,
            clock,
            evict_after_ms=evict_after_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            limits=limits,
            run_blocking=run_blocking,
            check_interval_ms=check_interval_ms,
        )
        if size:
            stats = registry.statistics()
            log.info(
                "restored %d servers in %d groups from %s (%d bytes); each has %.1f s to heartbeat",
                stats.servers,
                stats.groups,
                data_dir,
                size,
                evict_after_ms / 1000,
            )
        async with serve_frames(metaserver.server, bind=bind, tasks=[metaserver.run_expiry]) as address:
            metaserver.address = address or None  # None: no listener
            yield metaserver


__all__ = [
    "Metaserver",
    "MetaserverStatistics",
    "open_metaserver",
]
