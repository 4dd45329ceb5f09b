"""What the reading tasks hand back to Spark: tagged tuples, and the damage they found.

Each task returns a list of tuples whose first item is a tag below; the report
builders (``delaymq.backlog.reports``) turn each tag's tuples into a DataFrame.
Tasks aggregate before they return (one row per subject and hour, not per message),
except the two row kinds the delivery-lateness join needs (``ENTRY``, ``RECORD``).
"""

from __future__ import annotations

from bisect import bisect_right

#: ("backlog", scheduler_group, subject, hour, messages, bytes, overdue, unfiled, dispatched)
BACKLOG = "backlog"
#: ("horizon", scheduler_group, subject, bucket, messages)
HORIZON = "horizon"
#: ("problem", kind, group, file, offset, problem)
PROBLEM = "problem"
#: ("stored", realtime_group, subject, entries)
STORED = "stored"
#: ("share", realtime_group, subject, consumer_group, broadcast_consumer, waiting, redelivery_waiting, oldest_stored_at)
SHARE = "share"
#: ("unacked", realtime_group, subject, consumer_group, consumer, broadcast, unacked, unacked_redelivered)
UNACKED = "unacked"
#: ("entry", realtime_group, message_log_offset, stored_at): a committed consume-log entry
ENTRY = "entry"
#: ("record", realtime_group, message_log_offset, subject, deliver_at): a delayed message in realtime
RECORD = "record"

#: The subject under which entries whose record cannot be read are counted.
UNREADABLE = "(unreadable)"

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
DAY_MS = 86_400_000
#: Delay-horizon buckets (deliver_at - created_at): bucket i holds delays in [EDGES[i-1], EDGES[i]).
HORIZON_EDGES = (MINUTE_MS, 10 * MINUTE_MS, HOUR_MS, 6 * HOUR_MS, DAY_MS, 7 * DAY_MS, 30 * DAY_MS, 90 * DAY_MS,
                 365 * DAY_MS)  # fmt: skip
HORIZON_LABELS = ("< 1 min", "1-10 min", "10-60 min", "1-6 h", "6-24 h", "1-7 days", "7-30 days", "30-90 days",
                  "90-365 days", "> 1 year")  # fmt: skip


def horizon_bucket(delay_ms: int) -> int:
    """The bucket of a delay (a negative one, "deliver now", is bucket 0)."""
    return bisect_right(HORIZON_EDGES, delay_ms)


def horizon_bounds(bucket: int) -> tuple[int, int | None]:
    """``[low, high)`` of a bucket in ms; ``high`` None for the last."""
    low = 0 if bucket == 0 else HORIZON_EDGES[bucket - 1]
    high = HORIZON_EDGES[bucket] if bucket < len(HORIZON_EDGES) else None
    return low, high


class Problems:
    """Damage one task found, one row per file: the first place and what was wrong there,
    and how many more places of the same file did not check (so a cut file is one row)."""

    def __init__(self, kind: str, group: str) -> None:
        self._kind = kind
        self._group = group
        self._first: dict[str, tuple[int, str]] = {}
        self._more: dict[str, int] = {}

    def add(self, file: str, offset: int, problem: str) -> None:
        if file in self._first:
            self._more[file] = self._more.get(file, 0) + 1
        else:
            self._first[file] = (offset, problem)

    def __bool__(self) -> bool:
        return bool(self._first)

    def rows(self) -> list[tuple]:
        out = []
        for file, (offset, problem) in self._first.items():
            more = self._more.get(file, 0)
            text = problem if not more else f"{problem} (and {more} more place(s) in this file)"
            out.append((PROBLEM, self._kind, self._group, file, offset, text))
        return out


__all__ = [
    "BACKLOG",
    "DAY_MS",
    "ENTRY",
    "HORIZON",
    "HORIZON_EDGES",
    "HORIZON_LABELS",
    "HOUR_MS",
    "PROBLEM",
    "RECORD",
    "SHARE",
    "STORED",
    "UNACKED",
    "UNREADABLE",
    "Problems",
    "horizon_bounds",
    "horizon_bucket",
]
