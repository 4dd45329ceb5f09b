"""A replicated member's replication state, as its statistics, STATUS and metrics report it.

``ReplicationStatistics`` is built by the shell (``delaymq.replication.shell``) from the
member's session: the part every member has, then the master's (``MasterReplication``)
or the slave's (``SlaveReplication``) part. ``to_wire`` is the map that goes into a
STATUS answer's ``statistics.replication``; its keys come in a fixed order (msgpack
keeps it), and the server kinds' own fields (``cut_messages``, ``applied_offset``, the
slave's tick) appear only for the kind that has them. It is also a read-only
``Mapping`` over that map, as the metrics and the cli read it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReplicaProgress:
    address: str
    acked: int  # durable on the slave
    lag_bytes: int
    lag_ms: int  # how long since it last held everything the master had durable
    in_sync: bool
    seconds_since_fetch: float


@dataclass(frozen=True, slots=True)
class SourceStatistics:
    epoch: int
    mode: str
    min_insync: int
    durable_end: int
    high_watermark: int
    recorded_in_sync: tuple[str, ...]  # the in-sync set the metaserver recorded at this epoch
    fetches: int
    bytes_sent: int
    resets: int
    replicas: tuple[ReplicaProgress, ...]


@dataclass(frozen=True, slots=True)
class CutCounts:
    """What was cut back since start: records and bytes a deposed master's log held that
    the new master never had; ``messages`` where the server counts them (realtime)."""

    records: int = 0
    bytes: int = 0
    messages: int | None = None

    def __add__(self, other: CutCounts) -> CutCounts:
        if self.messages is None and other.messages is None:
            messages = None
        else:
            messages = (self.messages or 0) + (other.messages or 0)
        return CutCounts(self.records + other.records, self.bytes + other.bytes, messages)


@dataclass(frozen=True, slots=True)
class MasterReplication:
    """A master's side: how far its slaves hold the log."""

    high_watermark: int
    replicas: tuple[ReplicaProgress, ...]
    accepting: bool
    in_sync_recorded: tuple[str, ...] = ()  # the in-sync set the metaserver recorded at this epoch


@dataclass(frozen=True, slots=True)
class TickLag:
    """A slave's view of the tick its master streams (the scheduler's): how old the last one is,
    how far it is behind this member's clock (None: none came yet), and the dispatch records held."""

    age_ms: int | None
    behind_ms: int | None
    held_dispatch_entries: int


@dataclass(frozen=True, slots=True)
class SlaveReplication:
    """A slave's side: how far behind its master it is, and how its fetches go."""

    master_durable_end: int
    lag_bytes: int
    fetches: int
    fetch_failures: int
    tick: TickLag | None = None  # the scheduler's
    applied_offset: int | None = None  # the realtime server's: how far it applied the log


@dataclass(frozen=True, slots=True)
class ReplicationStatistics(Mapping[str, Any]):
    """One member's replication state (see the module docstring)."""

    mode: str
    min_insync: int
    durable_end: int
    history: list[tuple[int, int]]
    cut: CutCounts
    master: MasterReplication | None = None
    slave: SlaveReplication | None = None

    def to_wire(self) -> dict[str, Any]:
        """The ``replication`` map of STATUS and the metrics (key order included)."""
        cut = self.cut
        wire: dict[str, Any] = {
            "mode": self.mode,
            "min_insync": self.min_insync,
            "durable_end": self.durable_end,
            "history": self.history,
            "cut_records": cut.records,
        }
        if cut.messages is not None:
            wire["cut_messages"] = cut.messages
        wire["cut_bytes"] = cut.bytes
        if self.master is not None:
            wire["high_watermark"] = self.master.high_watermark
            wire["in_sync_recorded"] = list(self.master.in_sync_recorded)
            wire["replicas"] = [asdict(replica) for replica in self.master.replicas]
            wire["accepting"] = self.master.accepting
        if self.slave is not None:
            wire.update(_slave_wire(self.slave))
        return wire

    def __getitem__(self, key: str) -> Any:
        return self.to_wire()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_wire())

    def __len__(self) -> int:
        return len(self.to_wire())


def _slave_wire(slave: SlaveReplication) -> dict[str, Any]:
    wire: dict[str, Any] = {"master_durable_end": slave.master_durable_end, "lag_bytes": slave.lag_bytes}
    if slave.tick is not None:
        wire["tick_age_ms"] = slave.tick.age_ms
        wire["tick_behind_ms"] = slave.tick.behind_ms
        wire["held_dispatch_entries"] = slave.tick.held_dispatch_entries
    wire["fetches"] = slave.fetches
    wire["fetch_failures"] = slave.fetch_failures
    if slave.applied_offset is not None:
        wire["applied_offset"] = slave.applied_offset
    return wire


__all__ = [
    "CutCounts",
    "MasterReplication",
    "ReplicaProgress",
    "ReplicationStatistics",
    "SlaveReplication",
    "SourceStatistics",
    "TickLag",
]
