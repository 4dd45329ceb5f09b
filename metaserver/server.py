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
server groups that lose or regain their master; it wakes in time for the next
failover of a managed server group too, and a promotion is written before anyone is
told of it (its new epoch must survive a restart of the metaserver).

The parts: ``handlers`` (the commands and their wire metadata), ``snapshot_store``
(the snapshot in lmdb), ``timers`` (steady time, the expiry task), ``event_log``
(what is logged as the registry changes); ``Metaserver`` joins them, and
``open_metaserver`` runs one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from delaymq.clock import Clock
from delaymq.metaserver.answers import RegistryStatistics
from delaymq.metaserver.event_log import RegistryEventLog
from delaymq.metaserver.groups import (
    DEFAULT_EVICT_AFTER_MS,
    DEFAULT_FAILOVER_AFTER_MS,
    DEFAULT_HEARTBEAT_INTERVAL_MS,
)
from delaymq.metaserver.handlers import RequestHandlers
from delaymq.metaserver.registry import Registry
from delaymq.metaserver.snapshot_store import SnapshotStore, load_registry, log_restored
from delaymq.metaserver.timers import ExpiryTimer, SteadyTime
from delaymq.net.addresses import split_listen
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.net.requests import Handler
from delaymq.net.server import FrameServer, ServerStatistics
from delaymq.net.serving import serve_frames
from delaymq.storage.state import StateStore
from delaymq.storage.threads import RunBlocking, open_blocking, run_in_thread


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
        self._steady = SteadyTime(clock)
        self._snapshots = SnapshotStore(registry, store, run_blocking)
        rows = registry.status(self.steady_ms())  # one look at start serves every part
        self._restored = len(rows)
        self._event_log = RegistryEventLog(registry, rows)
        self._expiry = ExpiryTimer(
            registry,
            clock,
            self._steady,
            check_interval_ms=check_interval_ms,
            persist=self.persist,
            event_log=self._event_log,
        )
        self._handlers = RequestHandlers(
            registry,
            clock,
            self._steady,
            settle=self._settle,
            known={(row.group, row.address) for row in rows},
            evict_after_ms=evict_after_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            failover_after_ms=failover_after_ms,
        )
        self.server = FrameServer(self.handlers(), limits=limits)

    def steady_ms(self) -> int:
        """The registry's time: epoch ms at start, moved on by the monotonic clock only."""
        return self._steady.now_ms()

    def handlers(self) -> dict[int, Handler]:
        return self._handlers.table()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one connection (a socket, or an in-memory stream in tests)."""
        await self.server.serve_stream(stream)

    def statistics(self) -> MetaserverStatistics:
        return MetaserverStatistics(
            address=self.address,
            registry=self.registry.statistics(),
            transport=self.server.statistics(),
            snapshots_written=self._snapshots.snapshots_written,
            restored_servers=self._restored,
        )

    async def persist(self) -> None:
        """Write the registry snapshot if it changed; concurrent callers share one write."""
        await self._snapshots.persist()

    async def run_expiry(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Notice evictions every ``check_interval_ms``, and failovers when due, so
        they happen, are written and are logged on time."""
        await self._expiry.run(task_status=task_status)

    async def _settle(self, now: int) -> None:
        """After a request: write what it changed before it is answered, log it, and
        wake the expiry task if the request brought a failover forward."""
        await self.persist()
        self._event_log.notice(now)
        self._expiry.wake_if_due()


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
    most 1 s; failovers of managed server groups, after ``failover_after_ms`` of their
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
                load_registry,
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
            log_restored(registry, data_dir, size, evict_after_ms)
        async with serve_frames(metaserver.server, bind=bind, tasks=[metaserver.run_expiry]) as address:
            metaserver.address = address or None  # None: no listener
            yield metaserver


__all__ = [
    "Metaserver",
    "MetaserverStatistics",
    "open_metaserver",
]
