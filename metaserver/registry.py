"""The metaserver's registry: server groups, heartbeats, eviction, states, routes.

A sans-IO object: the network server feeds it requests and the time of each,
and it never reads a clock. Its times are for intervals (silence, eviction) and
versions, so the server feeds it a steady time, one that a wall-clock step does
not move (``Metaserver``: the wall clock at start plus the monotonic time
since). Time inside it never runs backwards: an earlier ``now_ms`` than one
already seen is taken as the latest seen.

Rules, each chosen so a route answer is safe to act on:

- A server is known by (group, address) and heartbeats with ``register`` (all
  fields again) or ``heartbeat`` (group and address only). A group's kind is
  fixed by its first server; a server of another kind is refused.
- A server is *evicted* once it has been silent for ``evict_after_ms`` or more
  (``now - last_heartbeat >= evict_after_ms``), and back at its next heartbeat.
  Evicted servers stay known (``status`` shows them with their age) until
  ``forget``.
- A group's master is the server that claimed mastership last (registered as
  master when it was new, a slave, or a new ``incarnation`` of a deposed
  master). The newest claim wins at once: the group's previous master is
  *superseded*, dropped from the group (and so from routes) and remembered as
  deposed, so a dead master never holds the group until its eviction, and a
  live one cannot take the group back: its heartbeats, and its registrations as
  master with the same incarnation, are refused (``Superseded``). It may come
  back as a slave, or as master after a restart (a new incarnation, which then
  supersedes the other). A server restarting on its own address (a new
  incarnation) is live again at its registration. A group is routed while its
  master is live; its live slaves come with it.
- ``version`` changes exactly when the view behind every route answer changes.
  Each change sets it to ``max(version + 1, now_ms)``, so a metaserver restored
  from an older snapshot, or started empty, never hands out a version that an
  earlier run used for other routes.

*Managed* groups (replicated ones: their servers send a ``replica`` report) follow
other mastership rules, because there the metaserver, not the servers, decides who
is master; the claim rules above are for the others:

- The first server of the group is its master; every later one is a slave, whatever
  role it registers with. Each change of master (the first, a failover, a graceful
  handover, a restart of the master) sets the group's *epoch* to ``max(epoch + 1,
  now_ms)`` (and above any epoch a member reports holding), so an epoch is never
  reused, even by a metaserver restored from an old snapshot.
- A server is known by its ``member`` id (its data folder) when it sends one: the same
  member at a new address takes over its entry and standing; another member at a
  known address replaces that entry (a new folder holds none of the old one's data).
  A member id belongs to the run (``incarnation``) that registered it while that run
  is live: another run claiming it from another address is refused (``MemberTaken``)
  until the old address is evicted, since the id is no secret (STATUS shows it). The
  same run may move, and a new run at the same address is a restart.
- The master silent for ``failover_after_ms`` is replaced by the live slave that is in
  its last reported ``in_sync`` list and holds the highest offset (tie: the lowest
  address); with none eligible the group waits for its master. The deposed master is
  kept as a slave: its next heartbeat is answered "you are a slave", not refused.
- ``handover`` asks the master to hand the group to an in-sync slave; the slave is
  promoted when the master reports ``handed_over`` equal to the epoch.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from delaymq.metaserver.routes import routable, select
from delaymq.protocol.routes import MEMBER_TAKEN, GroupState, RouteAnswer, RoutedGroup, RouteKind, ServerKind

GROUP_NAME_MAX = 128
HOST_MAX = 255
SOFTWARE_VERSION_MAX = 64
INCARNATION_MAX = 64
#: Deposed masters remembered per group (the oldest are forgotten first).
DEPOSED_KEPT = 16
# Only the record format's own cap: the configured subject limit is the
# protocol's to enforce, and the metaserver must not refuse what it allows.
SUBJECT_MAX_BYTES = 0xFFFF
PORT_MIN, PORT_MAX = 1, 65535
DEFAULT_EVICT_AFTER_MS = 30_000
DEFAULT_HEARTBEAT_INTERVAL_MS = 5_000
DEFAULT_FAILOVER_AFTER_MS = 5_000
#: A managed group's servers heartbeat at most every ``failover_after_ms // this``,
#: so a healthy master is never taken for dead.
HEARTBEATS_PER_FAILOVER = 5
MEMBER_MAX = 64
#: Addresses a master may list as in sync.
IN_SYNC_MAX = 64
#: Offsets and epochs are msgpack integers: at most a signed 64-bit value.
INT_MAX = 2**63 - 1
#: Mastership events kept until the server takes them (the oldest dropped first).
EVENTS_KEPT = 1024
SNAPSHOT_FORMAT = 3
#: Snapshot formats ``restore`` reads (1: before incarnations and deposed masters;
#: 2: before managed groups, epochs and members).
SNAPSHOT_FORMATS_READ = (1, 2, 3)

_GROUP_NAME = re.compile(r"[A-Za-z0-9._-]+")
_E = TypeVar("_E", bound=enum.Enum)


class Role(enum.StrEnum):
    """What a server says it is within its group (in a managed group: what the metaserver says)."""

    MASTER = "master"
    SLAVE = "slave"


class RegistryError(ValueError):
    """A refused request or snapshot; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Superseded(RegistryError):
    """A heartbeat or registration from a master that another server has superseded."""

    def __init__(self, group: str, address: str, by: str) -> None:
        super().__init__(
            "address",
            f"{address} was superseded as master of group {group!r} by {by} (the newest registration "
            "wins); it is not routed: restart it to register again, or register it as a slave",
        )
        self.by = by


class MemberTaken(RegistryError):
    """A registration claiming the member id of a live server of another run at another address."""

    def __init__(self, group: str, member: str, claimant: str, address: str, silent_ms: int, evict_in_ms: int) -> None:
        super().__init__(
            "member",
            f"member {member!r} of group {group!r} is live at {address} (heard from {silent_ms / 1000:.1f} s "
            f"ago), registered by another run of the server: {claimant} may not take its place. If {claimant} "
            f"is that member restarted, stop the process at {address}, or wait until it has been silent "
            f"{evict_in_ms / 1000:.1f} s more (it registers by itself then); otherwise give {claimant} a data "
            "folder of its own (a copied folder: delete its 'member' file)",
        )
        self.member = member
        self.address = address


# -- validation ---------------------------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(field: str, value: object, limit: int) -> str:
    if not isinstance(value, str):
        raise RegistryError(field, f"must be a string, got {type(value).__name__}")
    if not value:
        raise RegistryError(field, "must not be empty")
    if len(value) > limit:
        raise RegistryError(field, f"is {len(value)} characters, limit {limit}")
    return value


def _choice(field: str, kind: type[_E], value: object) -> _E:
    try:
        return kind(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(member.value) for member in kind)
        raise RegistryError(field, f"unknown {field} {_show(value)}, expected one of {allowed}") from None


def _count(field: str, value: object, *, minimum: int = 0, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RegistryError(field, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise RegistryError(field, f"is {value}, must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise RegistryError(field, f"is {value}, limit {maximum}")
    return value


def check_group_name(value: object, field: str = "group") -> str:
    """1..128 characters of A-Z a-z 0-9 . _ -"""
    name = _text(field, value, GROUP_NAME_MAX)
    if not _GROUP_NAME.fullmatch(name):
        raise RegistryError(field, f"{_show(name)} may use only A-Z a-z 0-9 . _ -")
    return name


def check_address(value: object, field: str = "address") -> str:
    """``host:port`` (IPv6 hosts in brackets), port 1..65535 written plainly."""
    address = _text(field, value, HOST_MAX + 6)
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        raise RegistryError(field, f"{_show(address)} is not host:port")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if not bare or (":" in bare and not bracketed) or any(c.isspace() or c in "[]/" for c in bare):
        raise RegistryError(field, f"{_show(address)} has a bad host (IPv6 goes in brackets)")
    if len(host) > HOST_MAX:
        raise RegistryError(field, f"host is {len(host)} characters, limit {HOST_MAX}")
    if not (port.isascii() and port.isdigit()) or port != str(int(port)):
        raise RegistryError(field, f"{_show(address)} has port {_show(port)}, not a plain number")
    if not PORT_MIN <= int(port) <= PORT_MAX:
        raise RegistryError(field, f"port {port} is outside {PORT_MIN}..{PORT_MAX}")
    return address


class ReplicationMode(enum.StrEnum):
    """How a group's master answers writes: after its slaves hold them (sync) or not."""

    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a server of a managed group says of its copy at each registration and heartbeat."""

    offset: int  # the end of its message log that is durable on its disk
    epoch: int  # the epoch it holds (0 before it knows one)
    mode: ReplicationMode | None = None  # master only
    in_sync: tuple[str, ...] = ()  # master only: the slaves it considers in sync now
    handed_over: int | None = None  # master only: the epoch it handed over, after a handover request

    def __post_init__(self) -> None:
        _count("replica.offset", self.offset, maximum=INT_MAX)
        _count("replica.epoch", self.epoch, maximum=INT_MAX)
        if self.mode is not None:
            object.__setattr__(self, "mode", _choice("replica.mode", ReplicationMode, self.mode))
        if len(self.in_sync) > IN_SYNC_MAX:
            raise RegistryError("replica.in_sync", f"lists {len(self.in_sync)} addresses, limit {IN_SYNC_MAX}")
        for i, address in enumerate(self.in_sync):
            check_address(address, f"replica.in_sync[{i}]")
        if self.handed_over is not None:
            _count("replica.handed_over", self.handed_over, maximum=INT_MAX)

    @classmethod
    def from_dict(cls, report: object) -> ReplicaReport:
        """From the decoded ``replica`` field; unknown keys are ignored."""
        data = _mapping("replica", report)
        for key in ("offset", "epoch"):
            if key not in data:
                raise RegistryError(f"replica.{key}", "is missing")
        in_sync = data.get("in_sync")
        if in_sync is None:
            in_sync = ()
        elif not isinstance(in_sync, list | tuple):
            raise RegistryError("replica.in_sync", f"must be a list of addresses, got {type(in_sync).__name__}")
        return cls(
            data["offset"],
            data["epoch"],
            mode=data.get("mode"),
            in_sync=tuple(in_sync),
            handed_over=data.get("handed_over"),
        )


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """A register request, checked and normalised when built."""

    group: str
    kind: ServerKind
    role: Role
    address: str
    software_version: str
    #: New at every start of the server: tells a restart from a deposed master still running.
    incarnation: str | None = None
    #: A stable id of the server's data folder: the server's identity across addresses.
    member: str | None = None
    #: Present for the servers of managed (replicated) groups.
    replica: ReplicaReport | None = None

    def __post_init__(self) -> None:
        check_group_name(self.group)
        object.__setattr__(self, "kind", _choice("kind", ServerKind, self.kind))
        object.__setattr__(self, "role", _choice("role", Role, self.role))
        check_address(self.address)
        _text("software_version", self.software_version, SOFTWARE_VERSION_MAX)
        if self.incarnation is not None:
            _text("incarnation", self.incarnation, INCARNATION_MAX)
        if self.member is not None:
            _text("member", self.member, MEMBER_MAX)
        if self.replica is not None and not isinstance(self.replica, ReplicaReport):
            raise RegistryError("replica", f"must be a ReplicaReport, got {type(self.replica).__name__}")

    @classmethod
    def from_dict(cls, request: Mapping[str, Any]) -> ServerInfo:
        """From a decoded request; unknown keys are ignored (newer servers may send more)."""
        if not isinstance(request, Mapping):
            raise RegistryError("request", f"must be a mapping, got {type(request).__name__}")
        fields = ("group", "kind", "role", "address", "software_version")
        for key in fields:
            if key not in request:
                raise RegistryError(key, "is missing")
        group, kind, role, address, version = (request[key] for key in fields)
        return cls(
            group,
            kind,
            role,
            address,
            version,
            incarnation=request.get("incarnation"),
            member=request.get("member"),
            replica=None if request.get("replica") is None else ReplicaReport.from_dict(request["replica"]),
        )


# -- answers ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """What a server learns at each heartbeat. ``role``, ``epoch`` and ``handover_to``
    are for the servers of managed groups (None otherwise)."""

    state: GroupState
    master: str | None  # address of the group's master, None if it has none
    route_version: int  # changed since last time: routes are worth asking again
    heartbeat_interval_ms: int
    role: Role | None = None  # what the metaserver says this server is
    epoch: int | None = None  # the group's epoch: the current master's term
    handover_to: str | None = None  # to the master only, while a handover is pending


@dataclass(frozen=True, slots=True)
class StatusRow:
    """One server, for ``delaymq status``. ``role`` is what it claims (in a managed
    group: what the metaserver assigned); ``is_master`` whether it is the master
    routes point at."""

    group: str
    kind: ServerKind
    role: Role
    address: str
    state: GroupState
    software_version: str
    seconds_since_heartbeat: float
    evicted: bool
    is_master: bool
    epoch: int = 0  # the group's epoch (0: not a managed group)
    member: str | None = None
    offset: int | None = None  # the durable offset it last reported (None: never)
    in_sync: bool = False  # listed in sync by the master's last report


@dataclass(frozen=True, slots=True)
class Handover:
    """A graceful handover the master was asked for."""

    group: str
    epoch: int  # the epoch being handed over; the promotion sets a higher one
    from_address: str
    to_address: str


@dataclass(frozen=True, slots=True)
class MasterChanged:
    """A managed group got a new master, or its master a new term (``reason``:
    "first", "failover", "handover", "restart")."""

    group: str
    old: str | None
    new: str
    epoch: int
    reason: str
    silent_ms: int = 0  # failover: how long the old master had been silent
    offset: int | None = None  # the new master's reported offset


@dataclass(frozen=True, slots=True)
class FailoverBlocked:
    """A managed group's master is silent and no slave may replace it: the group waits."""

    group: str
    master: str
    silent_ms: int
    in_sync: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HandoverDropped:
    """A pending handover that can no longer happen (its target left or went silent)."""

    group: str
    to_address: str
    reason: str


MastershipEvent = MasterChanged | FailoverBlocked | HandoverDropped


@dataclass(frozen=True, slots=True)
class RegistryStatistics:
    """Counts as of the latest time the registry was given."""

    groups: int
    servers: int
    routed_groups: int
    evicted_groups: int  # groups whose master is silent (masterless ones are not counted)
    evicted_servers: int
    version: int
    changes: int
    dirty: bool


# -- the registry -------------------------------------------------------------


@dataclass(slots=True)
class _Server:
    role: Role
    software_version: str
    last_heartbeat_ms: int
    master_claim: int  # order of its latest claim of mastership; 0 while a slave
    incarnation: str | None = None
    member: str | None = None
    offset: int | None = None  # managed groups: the durable offset it last reported
    epoch: int = 0  # managed groups: the epoch it last said it holds (not persisted)


@dataclass(frozen=True, slots=True)
class _Deposed:
    incarnation: str | None  # the superseded run's; a registration with another one is a restart
    by: str  # the address that superseded it


@dataclass(slots=True)
class _Group:
    kind: ServerKind
    state: GroupState
    servers: dict[str, _Server]
    deposed: dict[str, _Deposed]  # address -> record, oldest first
    managed: bool = False  # the metaserver decides its master (its servers report replicas)
    epoch: int = 0
    in_sync: tuple[str, ...] = ()  # as the master last reported
    handover_to: str | None = None  # a pending graceful handover's target
    waiting: bool = False  # its master is silent and no slave may replace it (logged once)

    def master(self) -> str | None:
        best: str | None = None
        best_claim = 0
        for address, server in self.servers.items():
            if server.role is Role.MASTER and server.master_claim > best_claim:
                best, best_claim = address, server.master_claim
        return best


class Registry:
    """Server groups and the routes to them. Not thread-safe: one task drives it."""

    def __init__(
        self,
        *,
        evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
    ) -> None:
        self._evict_after_ms = _count("evict_after_ms", evict_after_ms, minimum=1)
        self._heartbeat_interval_ms = _count("heartbeat_interval_ms", heartbeat_interval_ms, minimum=1)
        if heartbeat_interval_ms >= evict_after_ms:
            raise RegistryError(
                "heartbeat_interval_ms",
                f"is {heartbeat_interval_ms}, must be below evict_after_ms ({evict_after_ms})",
            )
        # Managed groups heartbeat HEARTBEATS_PER_FAILOVER times per failover_after_ms, at least every 1 ms.
        self._failover_after_ms = _count("failover_after_ms", failover_after_ms, minimum=HEARTBEATS_PER_FAILOVER)
        self._managed_interval_ms = min(heartbeat_interval_ms, failover_after_ms // HEARTBEATS_PER_FAILOVER)
        self._events: deque[MastershipEvent] = deque(maxlen=EVENTS_KEPT)
        self._groups: dict[str, _Group] = {}
        self._now_ms = 0
        self._claims = 0
        self._version = 0
        self._view: tuple[RoutedGroup, ...] = ()
        self._view_stale = False
        self._next_expiry_ms: int | None = None  # no live server expires before this
        self._answers: dict[RouteKind, RouteAnswer] = {}
        self._changes = 0
        self._persisted_changes = 0

    # -- servers --------------------------------------------------------------

    def register(self, info: ServerInfo | Mapping[str, Any], *, now_ms: int) -> HeartbeatReply:
        """Register a server or heartbeat with all its fields."""
        if not isinstance(info, ServerInfo):
            info = ServerInfo.from_dict(info)
        group = self._groups.get(info.group)
        if group is not None and group.kind is not info.kind:
            raise RegistryError(
                "kind", f"group {info.group!r} is a {group.kind} group, {info.address} says {info.kind}"
            )
        if group is not None:
            self._check_member(info, group, max(self._now_ms, _count("now_ms", now_ms)))
        if info.replica is not None or (group is not None and group.managed):
            return self._register_managed(info, group, self._advance(now_ms))
        deposed = group.deposed.get(info.address) if group is not None else None
        if deposed is not None and info.role is Role.MASTER and info.incarnation == deposed.incarnation:
            raise Superseded(info.group, info.address, deposed.by)
        now = self._advance(now_ms)
        if group is None:
            group = self._groups[info.group] = _Group(info.kind, GroupState.RW, {}, {})
        if deposed is not None:  # back as a slave, or restarted: no longer deposed
            del group.deposed[info.address]
            self._content_changed()
        server = group.servers.get(info.address)
        claims = info.role is Role.MASTER and (
            server is None
            or server.role is not Role.MASTER
            or (server.incarnation != info.incarnation and group.master() != info.address)
        )
        if server is None:
            server = group.servers[info.address] = _Server(info.role, info.software_version, now, 0)
            self._content_changed()
        else:
            self._beat(server, now)
            if server.role is not info.role:
                server.role = info.role
                server.master_claim = 0
                self._content_changed()
            if server.software_version != info.software_version:
                server.software_version = info.software_version
                self._changes += 1  # persisted, but no route shows it
        if server.incarnation != info.incarnation:
            server.incarnation = info.incarnation
            self._changes += 1  # persisted, but no route shows it
        if claims:
            server.master_claim = self._claim()
            self._supersede(group, info.address)
            self._content_changed()
        self._refresh(now)
        return self._reply(group)

    def kind_of(self, group: str) -> ServerKind | None:
        """The kind of server ``group`` holds; None for a group this registry does not know."""
        found = self._groups.get(group)
        return None if found is None else found.kind

    def superseded(self, group: str) -> dict[str, str]:
        """The deposed masters of ``group`` still remembered: address -> who superseded it."""
        found = self._groups.get(group)
        return {} if found is None else {address: record.by for address, record in found.deposed.items()}

    def heartbeat(
        self, group: str, address: str, *, now_ms: int, replica: ReplicaReport | Mapping[str, Any] | None = None
    ) -> HeartbeatReply:
        """The light heartbeat of a registered server: (group, address), and a managed
        group's ``replica`` report."""
        found = self._group(group)
        server = found.servers.get(check_address(address))
        if replica is not None and not isinstance(replica, ReplicaReport):
            replica = ReplicaReport.from_dict(replica)
        if server is None:
            deposed = found.deposed.get(address)
            if deposed is not None and not found.managed:
                raise Superseded(group, address, deposed.by)
            raise RegistryError("address", f"{address} is not registered in group {group!r}: register first")
        now = self._advance(now_ms)
        if found.managed:
            self._check_failover(group, found, now)  # before this beat counts: the master may be gone
            self._beat(server, now)
            if replica is not None:
                self._report(group, found, address, replica, now)
            self._check_failover(group, found, now)  # a slave eligible again
        else:
            self._beat(server, now)
        self._refresh(now)
        return self._reply(found, address)

    def handover(self, group: str, to: str | None = None, *, now_ms: int) -> Handover:
        """Admin: ask ``group``'s master to hand over to ``to`` (default: the live in-sync
        slave with the highest offset). Its heartbeat answers name the target until it
        reports ``handed_over``; then the target is promoted. Asking again for the same
        target answers the same; another target while one is pending is refused."""
        found = self._group(group)
        now = self._advance(now_ms)
        if not found.managed:
            raise RegistryError(
                "group",
                f"group {group!r} is not replicated: its servers report no replica state, so the metaserver "
                "does not choose its master",
            )
        self._check_failover(group, found, now)
        master = found.master()
        if master is None or not self._responsive(found.servers[master], now):
            silent = "" if master is None else f" ({master} silent for {self._silent_s(found, master, now)})"
            raise RegistryError("group", f"group {group!r} has no live master to hand over from{silent}")
        in_sync = ", ".join(found.in_sync) or "none"
        if to is None:
            target = self._best_slave(found, now)
            if target is None:
                raise RegistryError(
                    "to", f"group {group!r} has no live in-sync slave to hand over to (in sync: {in_sync})"
                )
        else:
            target = check_address(to, "to")
            server = found.servers.get(target)
            if target == master:
                raise RegistryError("to", f"{target} is already the master of group {group!r}")
            if server is None:
                raise RegistryError("to", f"{target} is not a server of group {group!r}")
            if not self._responsive(server, now):
                raise RegistryError("to", f"{target} has not heartbeated for {self._silent_s(found, target, now)}")
            if target not in found.in_sync:
                raise RegistryError(
                    "to", f"{target} is not in sync with master {master} of group {group!r} (in sync: {in_sync})"
                )
        if found.handover_to is not None and found.handover_to != target:
            raise RegistryError(
                "to",
                f"a handover of group {group!r} to {found.handover_to} is pending; it ends with that "
                "server's promotion, or when it leaves the group or falls silent",
            )
        if found.handover_to != target:
            found.handover_to = target
            self._changes += 1  # persisted, but no route shows it
        return Handover(group, found.epoch, master, target)

    def take_events(self) -> list[MastershipEvent]:
        """The mastership changes of managed groups since the last call, oldest first (for the log)."""
        events = list(self._events)
        self._events.clear()
        return events

    @property
    def next_deadline_ms(self) -> int | None:
        """No eviction or failover is due before this time (None: none is pending), as of
        the latest call; ``expire`` at that time acts on what is due."""
        return self._next_expiry_ms

    def forget(self, group: str, address: str) -> None:
        """Admin: drop a server, or the memory of a deposed master, for good (a group left
        with neither is dropped too)."""
        found = self._group(group)
        if check_address(address) in found.servers:
            self._remove(group, found, address, reason="it was forgotten")
        elif found.deposed.pop(address, None) is None:
            raise RegistryError("address", f"{address} is not registered in group {group!r}")
        if not found.servers and not found.deposed:
            del self._groups[group]
        self._content_changed()
        self._refresh(self._now_ms)

    def set_state(self, group: str, state: GroupState | str) -> None:
        """Admin: RW, R (read-only) or NRW. Kept across re-registration and restarts."""
        found = self._group(group)
        new = _choice("state", GroupState, state)
        if found.state is not new:
            found.state = new
            self._content_changed()
            self._refresh(self._now_ms)

    # -- queries --------------------------------------------------------------

    def route(self, route: RouteKind | str, *, now_ms: int, subject: str | None = None) -> RouteAnswer:
        """The groups for one route; ``subject`` is required for scheduler-delivery."""
        kind = _choice("route", RouteKind, route)
        if subject is not None or kind is RouteKind.SCHEDULER_DELIVERY:
            _check_subject(subject)
        now = self._advance(now_ms)
        self._refresh(now)
        answer = self._answers.get(kind)
        if answer is None:
            answer = self._answers[kind] = select(kind, self._view, self._version)
        return answer

    def expire(self, now_ms: int) -> bool:
        """Notice evictions due by ``now_ms``; true if the routes changed."""
        before = self._version
        self._refresh(self._advance(now_ms))
        return self._version != before

    @property
    def version(self) -> int:
        """The route version as of the latest time given (see ``route``)."""
        return self._version

    def status(self, now_ms: int) -> list[StatusRow]:
        """Every known server, sorted by group then address."""
        now = self._advance(now_ms)
        self._refresh(now)
        rows = []
        for name in sorted(self._groups):
            group = self._groups[name]
            master = group.master()
            for address in sorted(group.servers):
                server = group.servers[address]
                rows.append(
                    StatusRow(
                        group=name,
                        kind=group.kind,
                        role=server.role,
                        address=address,
                        state=group.state,
                        software_version=server.software_version,
                        seconds_since_heartbeat=(now - server.last_heartbeat_ms) / 1000,
                        evicted=not self._alive(server, now),
                        is_master=address == master,
                        epoch=group.epoch,
                        member=server.member,
                        offset=server.offset,
                        in_sync=group.managed and address in group.in_sync,
                    )
                )
        return rows

    def statistics(self) -> RegistryStatistics:
        now = self._now_ms
        self._refresh(now)
        evicted_groups = 0
        for group in self._groups.values():
            master = group.master()
            if master is not None and not self._alive(group.servers[master], now):
                evicted_groups += 1
        return RegistryStatistics(
            groups=len(self._groups),
            servers=sum(len(g.servers) for g in self._groups.values()),
            routed_groups=len(self._view),
            evicted_groups=evicted_groups,
            evicted_servers=sum(not self._alive(s, now) for g in self._groups.values() for s in g.servers.values()),
            version=self._version,
            changes=self._changes,
            dirty=self.dirty,
        )

    # -- persistence ----------------------------------------------------------

    @property
    def changes(self) -> int:
        """Count of changes to what ``snapshot`` holds (servers, roles, states), not heartbeats."""
        return self._changes

    @property
    def dirty(self) -> bool:
        """True if something worth persisting changed since ``mark_persisted``."""
        return self._changes != self._persisted_changes

    def mark_persisted(self, changes: int) -> None:
        """Record that the snapshot taken when ``changes`` was read is now durable.

        Read ``changes``, take ``snapshot()``, write it (in a thread), then call
        this: changes made during the write keep the registry dirty.
        """
        _count("changes", changes)
        if changes > self._changes:
            raise RegistryError("changes", f"is {changes}, only {self._changes} changes were made")
        self._persisted_changes = max(self._persisted_changes, changes)

    def snapshot(self) -> dict[str, Any]:
        """Everything but heartbeat times, as plain msgpack-able data."""
        return {
            "format": SNAPSHOT_FORMAT,
            "version": self._version,
            "master_claims": self._claims,
            "groups": [
                {
                    "group": name,
                    "kind": group.kind.value,
                    "state": group.state.value,
                    "servers": [
                        {
                            "address": address,
                            "role": server.role.value,
                            "software_version": server.software_version,
                            "master_claim": server.master_claim,
                            "incarnation": server.incarnation,
                            "member": server.member,
                            "offset": server.offset,
                        }
                        for address, server in sorted(group.servers.items())
                    ],
                    "deposed": [
                        {"address": address, "incarnation": record.incarnation, "by": record.by}
                        for address, record in group.deposed.items()
                    ],
                    "managed": group.managed,
                    "epoch": group.epoch,
                    "master": group.master(),
                    "in_sync": list(group.in_sync),
                    "handover_to": group.handover_to,
                }
                for name, group in sorted(self._groups.items())
            ],
        }

    @classmethod
    def restore(
        cls,
        snapshot: Mapping[str, Any],
        now_ms: int,
        *,
        evict_after_ms: int = DEFAULT_EVICT_AFTER_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        failover_after_ms: int = DEFAULT_FAILOVER_AFTER_MS,
    ) -> Registry:
        """Rebuild from ``snapshot()`` so a restarted metaserver answers routes at once.

        Heartbeat times are not persisted: every server counts as heard from at
        ``now_ms`` and gets a full ``evict_after_ms`` of grace. The last known
        routes are answered at once; servers that are really gone drop out after
        the grace period, exactly as if they had stopped just now. The version
        moves past the snapshot's, since the answers may differ from the last
        ones handed out (servers evicted then are routed now). A managed group
        keeps its epoch (the next change of master moves on from there), and its
        master gets a full ``failover_after_ms`` too.
        """
        registry = cls(
            evict_after_ms=evict_after_ms,
            heartbeat_interval_ms=heartbeat_interval_ms,
            failover_after_ms=failover_after_ms,
        )
        now = registry._advance(now_ms)
        data = _mapping("snapshot", snapshot)
        if data.get("format") not in SNAPSHOT_FORMATS_READ:
            raise RegistryError(
                "snapshot.format",
                f"is {_show(data.get('format'))}, this code reads {' or '.join(map(str, SNAPSHOT_FORMATS_READ))}",
            )
        saved_version = _count("snapshot.version", data.get("version"))
        claims = _count("snapshot.master_claims", data.get("master_claims"))
        groups = data.get("groups")
        if not isinstance(groups, list):
            raise RegistryError("snapshot.groups", "must be a list")
        for i, raw in enumerate(groups):
            where = f"snapshot.groups[{i}]"
            entry = _mapping(where, raw)
            name = check_group_name(entry.get("group"), f"{where}.group")
            if name in registry._groups:
                raise RegistryError(f"{where}.group", f"{name!r} appears twice")
            group = _Group(
                _choice(f"{where}.kind", ServerKind, entry.get("kind")),
                _choice(f"{where}.state", GroupState, entry.get("state")),
                {},
                {},
            )
            servers = entry.get("servers")
            if not isinstance(servers, list) or not servers:
                raise RegistryError(f"{where}.servers", "must be a non-empty list")
            for j, raw_server in enumerate(servers):
                at = f"{where}.servers[{j}]"
                item = _mapping(at, raw_server)
                address = check_address(item.get("address"), f"{at}.address")
                role = _choice(f"{at}.role", Role, item.get("role"))
                claim = _count(f"{at}.master_claim", item.get("master_claim"), minimum=1 if role is Role.MASTER else 0)
                version = _text(f"{at}.software_version", item.get("software_version"), SOFTWARE_VERSION_MAX)
                incarnation = _optional_text(f"{at}.incarnation", item.get("incarnation"), INCARNATION_MAX)
                member = _optional_text(f"{at}.member", item.get("member"), MEMBER_MAX)
                offset = item.get("offset")
                if offset is not None:
                    _count(f"{at}.offset", offset, maximum=INT_MAX)
                group.servers[address] = _Server(
                    role, version, now, claim if role is Role.MASTER else 0, incarnation, member, offset
                )
                claims = max(claims, claim)
            deposed = entry.get("deposed", [])
            if not isinstance(deposed, list):
                raise RegistryError(f"{where}.deposed", "must be a list")
            for j, raw_record in enumerate(deposed):
                at = f"{where}.deposed[{j}]"
                item = _mapping(at, raw_record)
                address = check_address(item.get("address"), f"{at}.address")
                incarnation = _optional_text(f"{at}.incarnation", item.get("incarnation"), INCARNATION_MAX)
                group.deposed[address] = _Deposed(incarnation, check_address(item.get("by"), f"{at}.by"))
            _restore_managed(where, entry, group)
            registry._groups[name] = group
        registry._claims = claims
        registry._view, registry._next_expiry_ms = registry._build_view(now)
        registry._version = max(saved_version + 1, now)
        return registry

    # -- internals ------------------------------------------------------------

    def _advance(self, now_ms: int) -> int:
        self._now_ms = max(self._now_ms, _count("now_ms", now_ms))
        return self._now_ms

    def _group(self, name: str) -> _Group:
        group = self._groups.get(check_group_name(name))
        if group is None:
            raise RegistryError("group", f"unknown group {name!r}")
        return group

    def _claim(self) -> int:
        self._claims += 1
        return self._claims

    def _supersede(self, group: _Group, master: str) -> None:
        """``master`` claimed the group: every other master is dropped and remembered as deposed."""
        for address in [a for a, s in group.servers.items() if s.role is Role.MASTER and a != master]:
            group.deposed.pop(address, None)
            group.deposed[address] = _Deposed(group.servers.pop(address).incarnation, master)
        while len(group.deposed) > DEPOSED_KEPT:
            del group.deposed[next(iter(group.deposed))]

    def _check_member(self, info: ServerInfo, group: _Group, now: int) -> None:
        """Refuse (changing nothing) a claim of a live member's id by another run at another address.

        A run that does not say its incarnation cannot show it is the same one.
        """
        if info.member is None:
            return
        for address, server in group.servers.items():
            # Live is: neither evicted nor silent past failover_after_ms (a master the metaserver
            # would fail over from): a crashed member restarted elsewhere takes its place that soon.
            live_ms = min(self._evict_after_ms, self._failover_after_ms)
            silent = now - server.last_heartbeat_ms
            if address == info.address or server.member != info.member or silent >= live_ms:
                continue
            if info.incarnation is not None and server.incarnation == info.incarnation:
                continue  # the same run, at a new address
            raise MemberTaken(info.group, info.member, info.address, address, silent, live_ms - silent)

    def _alive(self, server: _Server, now: int) -> bool:
        return now - server.last_heartbeat_ms < self._evict_after_ms

    def _beat(self, server: _Server, now: int) -> None:
        if not self._alive(server, now):
            self._view_stale = True  # back from eviction
        server.last_heartbeat_ms = now

    def _content_changed(self) -> None:
        self._changes += 1
        self._view_stale = True

    def _reply(self, group: _Group, address: str | None = None) -> HeartbeatReply:
        master = group.master()
        if not group.managed or address is None:
            return HeartbeatReply(group.state, master, self._version, self._heartbeat_interval_ms)
        return HeartbeatReply(
            group.state,
            master,
            self._version,
            self._managed_interval_ms,
            role=group.servers[address].role,
            epoch=group.epoch,
            handover_to=group.handover_to if address == master else None,
        )

    # -- managed groups -------------------------------------------------------

    def _register_managed(self, info: ServerInfo, group: _Group | None, now: int) -> HeartbeatReply:
        """``register`` for a managed group: the metaserver, not the server, says who is master."""
        name, address = info.group, info.address
        if group is None:
            group = self._groups[name] = _Group(info.kind, GroupState.RW, {}, {})
        if not group.managed:
            self._manage(name, group, now)
        self._check_failover(name, group, now)  # before this registration counts as a beat
        server = group.servers.get(address)
        if server is not None and None not in (info.member, server.member) and server.member != info.member:
            # Another data folder at this address: the old one's standing does not pass to it.
            self._remove(name, group, address, reason=f"member {info.member} replaced member {server.member}")
            server = None
        previous = address
        restarted = False
        holder = None
        if info.member is not None:
            holder = next((a for a, s in group.servers.items() if s.member == info.member and a != address), None)
        if holder is not None:  # the member moved (restarted on another address): same standing
            if server is not None:
                self._remove(name, group, address, reason=f"member {info.member} moved to its address")
            server = group.servers[address] = group.servers.pop(holder)
            group.in_sync = tuple(sorted(address if a == holder else a for a in group.in_sync))
            if group.handover_to == holder:
                group.handover_to = address
            self._content_changed()
            previous, restarted = holder, server.role is Role.MASTER
        if server is None:
            server = group.servers[address] = _Server(
                Role.SLAVE, info.software_version, now, 0, info.incarnation, info.member
            )
            self._content_changed()
        else:
            self._beat(server, now)
            if server.incarnation != info.incarnation:
                restarted = restarted or server.role is Role.MASTER
                server.incarnation = info.incarnation
                self._changes += 1  # persisted, but no route shows it
            if server.software_version != info.software_version:
                server.software_version = info.software_version
                self._changes += 1
            if info.member is not None and server.member != info.member:
                server.member = info.member
                self._changes += 1
        if info.replica is not None:
            server.epoch = info.replica.epoch  # a new term must be above it
        if group.master() is None and not self._check_failover(name, group, now):
            # A new group, or one whose master left with no slave to replace it.
            self._promote(name, group, address, now, reason="first")
        elif restarted:  # a new run of the master: a new term, so nothing of the old run passes as current
            self._promote(name, group, address, now, reason="restart", previous=previous)
        if info.replica is not None:  # after the promotions: a new master's report counts as the master's
            self._report(name, group, address, info.replica, now)
        self._refresh(now)
        return self._reply(group, address)

    def _manage(self, name: str, group: _Group, now: int) -> None:
        """A group turns managed (its first replica report): its master, if any, starts the first term."""
        group.managed = True
        group.deposed.clear()  # the claim rules are over: deposed masters come back as slaves
        self._content_changed()
        master = group.master()
        if master is not None:
            self._promote(name, group, master, now, reason="first")

    def _responsive(self, server: _Server, now: int) -> bool:
        """Heard from within ``failover_after_ms``: live enough to be, or become, a master."""
        return now - server.last_heartbeat_ms < self._failover_after_ms

    def _silent_s(self, group: _Group, address: str, now: int) -> str:
        return f"{(now - group.servers[address].last_heartbeat_ms) / 1000:.1f} s"

    def _best_slave(self, group: _Group, now: int) -> str | None:
        """The live in-sync slave with the highest reported offset (tie: the lowest address)."""
        eligible = [
            (-(server.offset or 0), address)
            for address in group.in_sync
            if (server := group.servers.get(address)) is not None
            and server.role is Role.SLAVE
            and self._responsive(server, now)
        ]
        return min(eligible)[1] if eligible else None

    def _check_failover(self, name: str, group: _Group, now: int) -> bool:
        """Replace a master silent for ``failover_after_ms`` if a slave may; true if one did."""
        if not group.managed:
            return False
        master = group.master()
        silent = 0
        if master is not None:
            silent = now - group.servers[master].last_heartbeat_ms
            if silent < self._failover_after_ms:
                group.waiting = False
                return False
        candidate = self._best_slave(group, now)
        if candidate is None:
            if master is not None and not group.waiting:
                group.waiting = True
                self._events.append(FailoverBlocked(name, master, silent, group.in_sync))
            return False
        self._promote(name, group, candidate, now, reason="failover", silent_ms=silent)
        return True

    def _promote(
        self,
        name: str,
        group: _Group,
        address: str,
        now: int,
        *,
        reason: str,
        silent_ms: int = 0,
        previous: str | None = None,
    ) -> None:
        """``address`` starts a new term as master: the epoch moves on, never to a value used before."""
        old = group.master()
        new = group.servers[address]
        if old is not None and old != address:
            group.servers[old].role = Role.SLAVE
            group.servers[old].master_claim = 0
        if old != address:
            new.role = Role.MASTER
            new.master_claim = self._claim()
        held = max(server.epoch for server in group.servers.values())
        group.epoch = max(group.epoch + 1, now, held + 1)
        if reason == "handover":
            group.in_sync = (old,) if old is not None else ()  # it handed over all it had
        elif reason != "restart":
            group.in_sync = ()  # the new master says who follows it
        if group.handover_to is not None and reason != "handover":
            self._events.append(HandoverDropped(name, group.handover_to, f"the master changed ({reason})"))
        group.handover_to = None
        group.waiting = False
        self._content_changed()
        if reason == "first":
            old = None
        elif reason == "restart":
            old = previous
        self._events.append(MasterChanged(name, old, address, group.epoch, reason, silent_ms, new.offset))

    def _report(self, name: str, group: _Group, address: str, report: ReplicaReport, now: int) -> None:
        """Take in a server's replica report; a master's may complete a handover."""
        server = group.servers[address]
        server.offset = report.offset  # persisted with the next snapshot, not worth one of its own
        server.epoch = report.epoch
        if server.role is not Role.MASTER:
            return
        in_sync = tuple(sorted(set(report.in_sync) - {address}))
        if in_sync != group.in_sync:
            group.in_sync = in_sync
            self._changes += 1  # persisted: a restarted metaserver must know whom it may promote
        target = group.handover_to
        if target is None:
            return
        if not self._responsive(group.servers[target], now):
            group.handover_to = None
            self._changes += 1
            self._events.append(
                HandoverDropped(name, target, f"it has not heartbeated for {self._silent_s(group, target, now)}")
            )
        elif report.handed_over == group.epoch:
            self._promote(name, group, target, now, reason="handover")

    def _remove(self, name: str, group: _Group, address: str, *, reason: str) -> None:
        """Drop a server's entry, and what of the group refers to it."""
        del group.servers[address]
        if address in group.in_sync:
            group.in_sync = tuple(a for a in group.in_sync if a != address)
        if group.handover_to == address:
            group.handover_to = None
            self._events.append(HandoverDropped(name, address, reason))
        self._content_changed()

    def _refresh(self, now: int) -> None:
        """Rebuild the view if something changed or a server may have expired."""
        if not self._view_stale and (self._next_expiry_ms is None or now < self._next_expiry_ms):
            return
        for name, group in self._groups.items():
            if group.managed and not group.waiting:
                self._check_failover(name, group, now)
        view, self._next_expiry_ms = self._build_view(now)
        self._view_stale = False
        if view != self._view:
            self._view = view
            self._version = max(self._version + 1, now)
            self._answers.clear()

    def _build_view(self, now: int) -> tuple[tuple[RoutedGroup, ...], int | None]:
        view = []
        next_expiry: int | None = None
        for name in sorted(self._groups):
            group = self._groups[name]
            for server in group.servers.values():
                if self._alive(server, now):
                    expiry = server.last_heartbeat_ms + self._evict_after_ms
                    next_expiry = expiry if next_expiry is None else min(next_expiry, expiry)
            master = group.master()
            if group.managed and master is not None and not group.waiting:
                failover = group.servers[master].last_heartbeat_ms + self._failover_after_ms
                if failover > now:
                    next_expiry = failover if next_expiry is None else min(next_expiry, failover)
            if master is None or not self._alive(group.servers[master], now):
                continue
            if not routable(group.kind, group.state):
                continue  # e.g. NRW: no answer shows it, so its changes bump nothing
            slaves = tuple(
                sorted(
                    address
                    for address, server in group.servers.items()
                    if server.role is Role.SLAVE and self._alive(server, now)
                )
            )
            view.append(RoutedGroup(name, group.kind, group.state, master, slaves))
        return tuple(view), next_expiry


def _check_subject(value: object) -> None:
    subject = _text("subject", value, SUBJECT_MAX_BYTES)
    try:
        size = len(subject.encode("utf-8"))
    except UnicodeEncodeError:
        raise RegistryError("subject", "is not valid UTF-8 text") from None
    if size > SUBJECT_MAX_BYTES:
        raise RegistryError("subject", f"is {size} UTF-8 bytes, limit {SUBJECT_MAX_BYTES}")


def _restore_managed(where: str, entry: Mapping[str, Any], group: _Group) -> None:
    """A snapshot group's format-3 fields (absent before: a group that is not managed)."""
    managed = entry.get("managed", False)
    if not isinstance(managed, bool):
        raise RegistryError(f"{where}.managed", f"must be true or false, got {_show(managed)}")
    epoch = _count(f"{where}.epoch", entry.get("epoch", 0), maximum=INT_MAX)
    in_sync = entry.get("in_sync", [])
    if not isinstance(in_sync, list):
        raise RegistryError(f"{where}.in_sync", "must be a list")
    addresses = tuple(check_address(a, f"{where}.in_sync[{i}]") for i, a in enumerate(in_sync))
    handover_to = entry.get("handover_to")
    if handover_to is not None:
        check_address(handover_to, f"{where}.handover_to")
    if "master" in entry:
        master = entry["master"]
        if master is not None:
            check_address(master, f"{where}.master")
        if master != group.master():
            raise RegistryError(f"{where}.master", f"is {_show(master)}, its servers say {_show(group.master())}")
    group.managed, group.epoch, group.in_sync = managed, epoch, addresses
    group.handover_to = handover_to if handover_to in group.servers else None


def _optional_text(field: str, value: object, limit: int) -> str | None:
    return None if value is None else _text(field, value, limit)


def _mapping(field: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RegistryError(field, f"must be a mapping, got {type(value).__name__}")
    return value


__all__ = [
    "DEFAULT_EVICT_AFTER_MS",
    "DEFAULT_FAILOVER_AFTER_MS",
    "DEFAULT_HEARTBEAT_INTERVAL_MS",
    "GROUP_NAME_MAX",
    "MEMBER_MAX",
    "MEMBER_TAKEN",
    "FailoverBlocked",
    "Handover",
    "HandoverDropped",
    "HeartbeatReply",
    "MasterChanged",
    "MastershipEvent",
    "MemberTaken",
    "Registry",
    "RegistryError",
    "RegistryStatistics",
    "ReplicaReport",
    "ReplicationMode",
    "Role",
    "ServerInfo",
    "StatusRow",
    "Superseded",
    "check_address",
    "check_group_name",
]
