"""The registry's state: server groups, their servers and deposed masters, the
intervals that judge a server's silence, and the bookkeeping every rule updates."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from delaymq.metaserver.answers import MastershipEvent
from delaymq.metaserver.checks import check_count
from delaymq.metaserver.errors import RegistryError
from delaymq.metaserver.requests import Role
from delaymq.protocol.routes import GroupState, ServerKind

DEFAULT_EVICT_AFTER_MS = 30_000
DEFAULT_HEARTBEAT_INTERVAL_MS = 5_000
#: A replicated group's master holds a lease this long from its last heartbeat (sent every
#: fifth of it): a 500 ms stall keeps it, a death costs about a second.
DEFAULT_FAILOVER_AFTER_MS = 1_000
#: A managed group's servers heartbeat at most every ``failover_after_ms // this``,
#: so a healthy master is never taken for dead.
HEARTBEATS_PER_FAILOVER = 5
#: Deposed masters remembered per server group (the oldest are forgotten first).
DEPOSED_KEPT = 16
#: Mastership events kept until the server takes them (the oldest dropped first).
EVENTS_KEPT = 1024


@dataclass(slots=True)
class ServerEntry:
    """A server of a server group, as the registry knows it (its address is its key)."""

    role: Role
    software_version: str
    last_heartbeat_ms: int
    master_claim: int  # order of its latest claim of mastership; 0 while a slave
    incarnation: str | None = None
    member: str | None = None  # the id of its data folder: its identity across addresses
    offset: int | None = None  # managed groups: the durable offset it last reported
    epoch: int = 0  # managed groups: the epoch it last said it holds (not persisted)


@dataclass(frozen=True, slots=True)
class DeposedMaster:
    """A master another server superseded, remembered so it cannot take its group back."""

    incarnation: str | None  # the superseded run's; a registration with another one is a restart
    by: str  # the address that superseded it


@dataclass(slots=True)
class ServerGroup:
    kind: ServerKind
    state: GroupState
    servers: dict[str, ServerEntry]  # address -> entry
    deposed: dict[str, DeposedMaster]  # address -> record, oldest first
    managed: bool = False  # the metaserver decides its master (its servers report replicas)
    epoch: int = 0
    in_sync: tuple[str, ...] = ()  # as the master last reported
    handover_to: str | None = None  # a pending graceful handover's target
    waiting: bool = False  # its master is silent and no slave may replace it (logged once)

    def master(self) -> str | None:
        """The address of the server with the latest claim of mastership."""
        best: str | None = None
        best_claim = 0
        for address, server in self.servers.items():
            if server.role is Role.MASTER and server.master_claim > best_claim:
                best, best_claim = address, server.master_claim
        return best

    def supersede(self, master: str) -> None:
        """``master`` claimed the group: every other master is dropped and remembered as deposed."""
        for address in [a for a, s in self.servers.items() if s.role is Role.MASTER and a != master]:
            self.deposed.pop(address, None)
            self.deposed[address] = DeposedMaster(self.servers.pop(address).incarnation, master)
        while len(self.deposed) > DEPOSED_KEPT:
            del self.deposed[next(iter(self.deposed))]


@dataclass(frozen=True, slots=True)
class Intervals:
    """How long a server may be silent: before eviction, and (a managed group's master) before failover."""

    evict_after_ms: int = DEFAULT_EVICT_AFTER_MS
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS

    def __post_init__(self) -> None:
        check_count("evict_after_ms", self.evict_after_ms, minimum=1)
        check_count("heartbeat_interval_ms", self.heartbeat_interval_ms, minimum=1)
        if self.heartbeat_interval_ms >= self.evict_after_ms:
            raise RegistryError(
                "heartbeat_interval_ms",
                f"is {self.heartbeat_interval_ms}, must be below evict_after_ms ({self.evict_after_ms})",
            )
        # Managed groups heartbeat HEARTBEATS_PER_FAILOVER times per failover_after_ms, at least every 1 ms.
        check_count("failover_after_ms", self.failover_after_ms, minimum=HEARTBEATS_PER_FAILOVER)

    @property
    def managed_interval_ms(self) -> int:
        """The heartbeat interval of a managed group's servers."""
        return min(self.heartbeat_interval_ms, self.failover_after_ms // HEARTBEATS_PER_FAILOVER)

    def alive(self, server: ServerEntry, now: int) -> bool:
        """Not evicted."""
        return now - server.last_heartbeat_ms < self.evict_after_ms

    def responsive(self, server: ServerEntry, now: int) -> bool:
        """Heard from within ``failover_after_ms``: live enough to be, or become, a master."""
        return now - server.last_heartbeat_ms < self.failover_after_ms

    def silent_s(self, group: ServerGroup, address: str, now: int) -> str:
        """How long a server has been silent, for a message."""
        return f"{(now - group.servers[address].last_heartbeat_ms) / 1000:.1f} s"


@dataclass(slots=True)
class RegistryState:
    """The server groups, and the bookkeeping every registry rule updates."""

    intervals: Intervals
    groups: dict[str, ServerGroup] = field(default_factory=dict)
    #: Changes to what a snapshot holds (servers, roles, states), not heartbeats.
    changes: int = 0
    #: Something a route answer shows may have changed: rebuild the route view.
    view_stale: bool = False
    #: Claims of mastership numbered so far: the latest claim holds the highest number.
    claims: int = 0
    #: When a server of a replicated group was last heard (0: never since start).
    managed_heard_ms: int = 0
    events: deque[MastershipEvent] = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))

    def content_changed(self) -> None:
        """A change that is persisted and may change the routes."""
        self.changes += 1
        self.view_stale = True

    def claim(self) -> int:
        self.claims += 1
        return self.claims

    def beat(self, server: ServerEntry, now: int) -> None:
        if not self.intervals.alive(server, now):
            self.view_stale = True  # back from eviction
        server.last_heartbeat_ms = now


__all__ = [
    "DEFAULT_EVICT_AFTER_MS",
    "DEFAULT_FAILOVER_AFTER_MS",
    "DEFAULT_HEARTBEAT_INTERVAL_MS",
    "DEPOSED_KEPT",
    "EVENTS_KEPT",
    "HEARTBEATS_PER_FAILOVER",
    "DeposedMaster",
    "Intervals",
    "ServerEntry",
    "RegistryState",
    "ServerGroup",
]
