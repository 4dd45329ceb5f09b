"""What the registry answers: heartbeat replies, status rows, statistics, and the
mastership events the metaserver logs."""

from __future__ import annotations

from dataclasses import dataclass

from delaymq.metaserver.requests import Role
from delaymq.protocol.routes import GroupState, ServerKind


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """What a server learns at each heartbeat. ``role``, ``epoch``, ``handover_to`` and
    ``in_sync`` are for the servers of managed groups (None otherwise)."""

    state: GroupState
    master: str | None  # address of the group's master, None if it has none
    route_version: int  # changed since last time: routes are worth asking again
    heartbeat_interval_ms: int
    role: Role | None = None  # what the metaserver says this server is
    epoch: int | None = None  # the group's epoch: the current master's term
    handover_to: str | None = None  # to the master and the target, while a handover is pending
    in_sync: tuple[str, ...] | None = None  # to the master only: the in-sync set recorded at ``epoch``


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


@dataclass(frozen=True, slots=True)
class HeardAgain:
    """No server of a replicated group was heard for ``silent_ms``: the silence was the
    metaserver's own (cut off, frozen), so no master is failed over for it."""

    silent_ms: int


MastershipEvent = MasterChanged | FailoverBlocked | HandoverDropped | HeardAgain


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


__all__ = [
    "FailoverBlocked",
    "Handover",
    "HandoverDropped",
    "HeardAgain",
    "HeartbeatReply",
    "MasterChanged",
    "MastershipEvent",
    "RegistryStatistics",
    "StatusRow",
]
