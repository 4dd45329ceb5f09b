"""What a scheduler tells about itself: ``statistics()`` and the STATUS command's answer.

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

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.scheduler.hours import hour_name
from delaymq.storage.state import pack, unpack
from delaymq.wheel import HOUR_MS, Tick

#: Hours a STATUS answer lists unless asked otherwise, and at most.
DEFAULT_STATUS_HOURS = 48
MAX_STATUS_HOURS = 20_000


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """A snapshot of a scheduler's counters."""

    address: str
    group: str
    role: str  # "master", "slave" or "waiting"
    epoch: int  # the group epoch of the member's session (0: standalone)
    master: str | None  # the group's master as the metaserver names it
    replication: dict[str, Any]  # mode, min_insync, offsets; a master's replicas, a slave's lag and tick
    # Counters: totals since the data folder was created (``SchedulerCounters``).
    schedule_requests: int  # SCHEDULE requests answered
    scheduled: int  # records accepted into the message log
    rewritten: int  # of them, with a past deliver_at set to the time of receipt
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
    # How long fsyncs take, µs (``LatencyHistogram.to_wire``), by log: "message" (the message
    # log's group commit), "schedule" (each of filing's: ``filing_fsyncs``), "dispatch" (each
    # dispatch-log flush)
    fsync_us: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Bytes on disk besides the message log's: "schedule" (the hours' schedule logs, delay
    # indexes and heads tables), "dispatch" (dispatch logs); counted, not walked per snapshot
    log_bytes: dict[str, int] = field(default_factory=dict)
    # SCHEDULE requests that waited for filing to catch up (``max_unfiled_bytes``) since start
    schedule_waits: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerCounters:
    """A member's totals since its data folder was created: what its lmdb state keeps
    (``COUNTERS_DB``) and loads at start, plus what this process counted since."""

    schedule_requests: int = 0
    scheduled: int = 0
    rewritten: int = 0
    filed: int = 0
    dispatched: int = 0
    dispatch_batches: int = 0
    dispatch_failures: int = 0
    deleted_hours: int = 0
    deleted_segments: int = 0
    cut_records: int = 0
    cut_bytes: int = 0

    def __add__(self, other: SchedulerCounters) -> SchedulerCounters:
        return SchedulerCounters(*(getattr(self, name) + getattr(other, name) for name in _COUNTER_NAMES))

    def pack(self) -> bytes:
        """The stored form: a msgpack map of name to count."""
        return pack(asdict(self))

    @classmethod
    def unpack(cls, data: bytes) -> SchedulerCounters:
        """Read the stored form; names it does not know are ignored, missing ones are 0
        (another version wrote it). ``ValueError`` if it is not a map of counts."""
        try:
            stored = unpack(data)
        except Exception as error:  # msgpack raises several kinds
            raise ValueError(f"not msgpack: {error}") from None
        if not isinstance(stored, dict):
            raise ValueError(f"a {type(stored).__name__}, not a map")
        counts = {}
        for name in _COUNTER_NAMES:
            value = stored.get(name, 0)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} is {value!r}, not a count")
            counts[name] = value
        return cls(**counts)


_COUNTER_NAMES = tuple(field.name for field in fields(SchedulerCounters))
#: Where the counters are kept in a scheduler's lmdb state (one key).
COUNTERS_DB = "scheduler.counters"
COUNTERS_KEY = b"totals"


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
        "statistics": asdict(statistics),
    }


__all__ = [
    "COUNTERS_DB",
    "COUNTERS_KEY",
    "DEFAULT_STATUS_HOURS",
    "MAX_STATUS_HOURS",
    "SchedulerCounters",
    "SchedulerStatistics",
    "parse_status_request",
    "status_answer",
]
