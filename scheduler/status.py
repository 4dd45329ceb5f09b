"""What a scheduler tells about itself: ``statistics()`` and the STATUS command's answer.

STATUS (command 14, the code the metaserver's STATUS uses) takes ``{hours?}`` (how
many hours to list, default 48) and answers::

    {group, address, now_ms,
     tick: {second, done, limit, hour},          # hour: YYYYMMDDHH of the tick's second
     hours: [{hour, name, pending, open, overdue}],  # hours with undelivered messages, oldest first
     statistics: {...}}                          # SchedulerStatistics as a map

``delaymq status`` asks every scheduler the metaserver knows and shows its tick and
the pending count of each listed hour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from delaymq.protocol.errors import RemoteProtocolError
from delaymq.scheduler.hours import hour_name
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
    schedule_requests: int  # SCHEDULE requests answered
    scheduled: int  # records accepted into the message log
    rewritten: int  # of them, with a past deliver_at set to the time of receipt
    message_log_end: int
    checkpoint: int  # message-log offset replay has filed up to
    filed: int  # records filed into schedule logs since start
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
    lanes: int  # subjects with records on the way to realtime
    waiting: int  # records handed out, not yet accepted
    in_outage: bool  # delivery to realtime is failing right now
    deleted_hours: int  # hours removed past their retention
    deleted_segments: int  # message-log segments removed below the checkpoint


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
    "DEFAULT_STATUS_HOURS",
    "MAX_STATUS_HOURS",
    "SchedulerStatistics",
    "parse_status_request",
    "status_answer",
]
