"""What a scheduler tells about itself: ``statistics()`` and the STATUS command's answer.

``take_statistics`` assembles a ``SchedulerStatistics`` snapshot from a member and its
session; its nested parts are typed, and read as the maps they are on the wire:
``replication`` is the ``ReplicationStatistics`` every replicated server reports (built by
the shell, ``ReplicatedServer.replication_statistics``; the slave's tick from
``tick_lag``), ``FsyncDurations`` and ``LogBytes`` are ``WireMap``s.

STATUS (command 14, the code the metaserver's STATUS uses) takes ``{hours?}`` (how
many hours to list, default 48) and answers::

    {group, address, now_ms,
     tick: {second, done, limit, hour},          # hour: YYYYMMDDHH of the tick's second
     hours: [{hour, name, pending, open, overdue}],  # hours with undelivered messages, oldest first
     statistics: {...}}                          # SchedulerStatistics as a map

``delaymq status`` asks every scheduler the metaserver knows and shows its tick and
the pending count of each listed hour.

The counters (``SchedulerCounters``: scheduled, filed, dispatched, ...) are totals since
the data folder was created: the server saves them in its lmdb state at most once a
second while they change and loads them at start, so a restart keeps them (a kill
loses at most the last second's increments). Whether filing is done does not depend
on them: ``unfiled_bytes`` and ``unfiled_records`` say what lies between the replay
checkpoint and the message log's end.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.replication.roles import Role
from delaymq.replication.statistics import ReplicationStatistics, TickLag
from delaymq.scheduler.counters import COUNTERS_DB, COUNTERS_KEY, SchedulerCounters
from delaymq.scheduler.current import SessionRole
from delaymq.scheduler.dispatcher import DispatcherStatistics
from delaymq.scheduler.hours import hour_name
from delaymq.scheduler.roles import Member, SlaveSession
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.writer import LogWriter
from delaymq.wheel import HOUR_MS, Tick

#: Hours a STATUS answer lists unless asked otherwise, and at most.
DEFAULT_STATUS_HOURS = 48
MAX_STATUS_HOURS = 20_000


class WireMap(Mapping[str, Any]):
    """A typed part of a statistics snapshot that reads as the map it is on the wire
    (``to_wire``): the metrics and ``delaymq status`` read it by key, as they read the
    realtime server's."""

    __slots__ = ()

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_wire()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_wire())

    def __len__(self) -> int:
        return len(self.to_wire())


# eq=False: equal to a map with the same items (``Mapping.__eq__``), as the dict it was.
@dataclass(frozen=True, slots=True, eq=False)
class LogBytes(WireMap):
    """Bytes on disk besides the message log's, counted (not walked per snapshot)."""

    schedule: int  # the hours' schedule logs, delay indexes and heads tables
    dispatch: int  # the dispatch logs

    @classmethod
    def of(cls, store: ScheduleStore) -> LogBytes:
        sizes = store.log_bytes()
        return cls(schedule=sizes["schedule"], dispatch=sizes["dispatch"])

    def to_wire(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "dispatch": self.dispatch}


@dataclass(frozen=True, slots=True, eq=False)
class FsyncDurations(WireMap):
    """How long fsyncs take, µs, by log; each a ``LatencyHistogram.to_wire`` map."""

    message: dict[str, Any] | None  # the message log's group commit (None: no writer open)
    schedule: dict[str, Any]  # each of filing's (``filing_fsyncs``)
    dispatch: dict[str, Any]  # each dispatch-log flush

    @classmethod
    def of(cls, store: ScheduleStore, writer: LogWriter | None) -> FsyncDurations:
        filing = store.fsync_durations_us()
        message = writer.fsync_durations_us() if writer is not None else None
        return cls(message=message, schedule=filing["schedule"], dispatch=filing["dispatch"])

    def to_wire(self) -> dict[str, Any]:
        wire = {} if self.message is None else {"message": self.message}
        wire.update(schedule=self.schedule, dispatch=self.dispatch)
        return wire


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A snapshot of a scheduler's counters."""

    address: str
    group: str
    role: str  # a ``Role``'s value: "master" only while it takes requests
    epoch: int  # the group epoch of the member's session (0: standalone)
    master: str | None  # the group's master as the metaserver names it
    replication: ReplicationStatistics  # the shared one (``delaymq.replication.statistics``): read as its wire map
    # Counters: totals since the data folder was created (``SchedulerCounters``).
    schedule_requests: int  # SCHEDULE requests answered
    scheduled: int  # records accepted into the message log
    rewritten: int  # of them, already due when received: filed for dispatch at once
    message_log_end: int
    checkpoint: int  # message-log offset replay has filed up to
    filed: int  # records filed into schedule logs
    # What replay has yet to file: the message log between the checkpoint and its end.
    unfiled_bytes: int
    unfiled_records: int  # -1 until counted (STATUS counts them; ``Scheduler.unfiled()``)
    unfiled_exact: bool  # False: more than ``UNFILED_COUNT_BYTES`` to file, records estimated from those
    message_log_bytes: int  # what the message log holds on disk: segments not deleted yet
    message_log_segments: int
    pending: int  # filed, not yet recorded as delivered
    hours: int  # hours with undelivered messages
    open_hours: int  # hours on a second wheel now
    loaded: int  # entries in memory: read ahead, or sent and not yet confirmed
    # What memory holds besides; each bounded by the open hours or one replay step, never
    # by the backlog (docs/scheduler.md, "Memory"):
    buffered: int  # replay arrivals waiting for a disk read of their (open) hour
    cached_records: int  # records read ahead (of loaded entries)
    delivered_held: int  # delivered entry numbers of the open hours (restart skip sets)
    heads_held_max: int  # the most heads slots one replay step held
    tick: Tick
    dispatched: int  # records a realtime server accepted
    dispatch_batches: int
    dispatch_failures: int  # SEND attempts that failed (and were retried)
    lateness_max_ms: int  # accepted by realtime - deliver_at, worst since start
    lateness_mean_ms: float
    # Where the delay path's time and disk work go (``delaymq bench delay`` reads these):
    lateness_fired: dict[str, Any]  # fired - deliver_at per message, ms (``LatencyHistogram.to_wire``)
    fire_rounds: int  # times the dispatcher fired due messages
    confirm_rounds: int  # dispatch-log rounds (one flush each)
    message_log_fsyncs: int  # fsyncs of the message log (its writer's)
    filing_fsyncs: int  # fsyncs and file-system syncs of filing into schedule logs
    lanes: int  # subjects with records on the way to realtime
    waiting: int  # records handed out, not yet accepted
    in_outage: bool  # delivery to realtime is failing right now
    deleted_hours: int  # hours removed past their retention
    deleted_segments: int  # message-log segments removed below the checkpoint
    fsync_us: FsyncDurations
    log_bytes: LogBytes
    # SCHEDULE requests that waited for filing to catch up (``max_unfiled_bytes``) since start
    schedule_waits: int = 0
    # What damage on disk cost (totals, like the counters): schedule-log records that did not
    # check when read to be sent (skipped, recorded done), and message-log bytes found lost
    # below the checkpoint on open (filed already: no message lost).
    damaged_records: int = 0
    lost_log_bytes: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The ``statistics`` map of a STATUS answer, field by field in order."""
        return {item.name: _wire(getattr(self, item.name)) for item in fields(self)}


def _wire(value: Any) -> Any:
    if isinstance(value, WireMap | ReplicationStatistics):
        return value.to_wire()
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return value


def take_statistics(
    *,
    member: Member,
    session: SessionRole,
    role: Role,
    replication: ReplicationStatistics,
    wheels: WheelSet,
    dispatch: DispatcherStatistics,
    totals: SchedulerCounters,
    master_address: str | None,
    schedule_waits: int,
) -> SchedulerStatistics:
    """A snapshot of ``member`` running ``session`` (reported as ``role``); ``unfiled_records``
    is -1 (counting reads the log: ``Scheduler.unfiled()``, STATUS). ``totals``: ``Scheduler.counters()``."""
    message_log, store, writer, master = member.log, member.store, member.writer, session.master
    segments = message_log.segments()
    counts = wheels.counts()
    filing = store.statistics()
    tick = wheels.tick(member.clock.now_ms())
    if session.slave is not None and session.slave.master_tick is not None:
        tick = session.slave.master_tick.tick  # a slave's wheels are idle: the master's tick says where it is
    return SchedulerStatistics(
        address=member.address,
        group=member.group,
        role=role.value,
        epoch=session.epoch,
        master=master_address,
        replication=replication,
        schedule_requests=totals.schedule_requests,
        scheduled=totals.scheduled,
        rewritten=totals.rewritten,
        message_log_end=message_log.end_offset,
        checkpoint=store.checkpoint,
        filed=totals.filed,
        unfiled_bytes=max(0, message_log.end_offset - store.checkpoint),
        unfiled_records=-1,
        unfiled_exact=False,
        message_log_bytes=sum(size for _base, size in segments),
        message_log_segments=len(segments),
        pending=(master.pending + master.filed - master.cancelled - dispatch.recorded) if master is not None else -1,
        hours=counts.hours,
        open_hours=counts.open_hours,
        loaded=counts.scheduled + counts.in_flight,
        buffered=counts.buffered,
        cached_records=dispatch.cached_records,
        delivered_held=dispatch.delivered_held,
        heads_held_max=filing.heads_held_max,
        tick=tick,
        dispatched=totals.dispatched,
        dispatch_batches=totals.dispatch_batches,
        dispatch_failures=totals.dispatch_failures,
        lateness_max_ms=dispatch.lateness_max_ms,
        lateness_mean_ms=dispatch.lateness_mean_ms,
        lateness_fired=dispatch.lateness_fired,
        fire_rounds=dispatch.fire_rounds,
        confirm_rounds=dispatch.confirm_rounds,
        message_log_fsyncs=writer.statistics().fsyncs if writer is not None else 0,
        filing_fsyncs=filing.fsyncs + filing.syncfs,
        lanes=dispatch.lanes,
        waiting=dispatch.waiting,
        in_outage=dispatch.in_outage,
        deleted_hours=totals.deleted_hours,
        deleted_segments=totals.deleted_segments,
        fsync_us=FsyncDurations.of(store, writer),
        log_bytes=LogBytes.of(store),
        schedule_waits=schedule_waits,
        damaged_records=totals.damaged_records,
        lost_log_bytes=totals.lost_log_bytes,
    )


def tick_lag(member: Member, slave: SlaveSession) -> TickLag:
    """A slave's view of its master's tick stream (its part of ``ReplicationStatistics``)."""
    received, clock = slave.master_tick, member.clock
    return TickLag(
        age_ms=None if received is None else clock.monotonic_ms() - received.received_ms,
        behind_ms=None if received is None else max(0, clock.now_ms() - received.master_now_ms),
        held_dispatch_entries=member.records.held,
    )


def parse_status_request(metadata: Mapping[str, Any]) -> int:
    """How many hours a STATUS request wants listed; refuses unknown or bad fields."""
    for key in metadata:
        if key != "hours":
            raise RemoteProtocolError(f"STATUS: unknown field {key!r} (known: hours)", code="bad_request", field=key)
    hours = metadata.get("hours", DEFAULT_STATUS_HOURS)
    if type(hours) is not int or not 1 <= hours <= MAX_STATUS_HOURS:
        raise RemoteProtocolError(
            f"STATUS: hours is {hours!r}, must be an int from 1 to {MAX_STATUS_HOURS}",
            code="limit",
            field="hours",
            limit=MAX_STATUS_HOURS,
        )
    return hours


def status_answer(
    statistics: SchedulerStatistics,
    *,
    now_ms: int,
    hours: Sequence[int],
    pending: Sequence[int],
    open_hours: Sequence[int],
) -> dict[str, Any]:
    """The STATUS answer from a statistics snapshot and the listed hours' pending counts."""
    tick = statistics.tick
    opened = set(open_hours)
    return {
        "group": statistics.group,
        "address": statistics.address,
        "role": statistics.role,
        "epoch": statistics.epoch,
        "now_ms": now_ms,
        "tick": {"second": tick.second, "done": tick.done, "limit": tick.limit, "hour": hour_name(tick.hour)},
        "hours": [
            {
                "hour": hour,
                "name": hour_name(hour),
                "pending": count,
                "open": hour in opened,
                "overdue": (hour + 1) * HOUR_MS <= now_ms,
            }
            for hour, count in zip(hours, pending)
            if count > 0  # an open hour stays listed in the wheels until it has ended
        ],
        "statistics": statistics.to_wire(),
    }


__all__ = [
    "COUNTERS_DB",
    "COUNTERS_KEY",
    "DEFAULT_STATUS_HOURS",
    "MAX_STATUS_HOURS",
    "FsyncDurations",
    "LogBytes",
    "SchedulerCounters",
    "SchedulerStatistics",
    "WireMap",
    "parse_status_request",
    "status_answer",
    "take_statistics",
    "tick_lag",
]
