"""A scheduler's counters: ``SchedulerCounters``, totals since its data folder was created.

The server saves them in its lmdb state (``COUNTERS_DB``) at most once a second while
they change and loads them at start, so a restart keeps them (a kill loses at most the
last second's increments). Each part of the server counts its own share
(``counters()``); the server adds them up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from delaymq.scheduler.dispatcher import DispatcherStatistics
from delaymq.storage.state import pack, unpack


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
    damaged_records: int = 0  # schedule-log records that did not check when read to be sent: skipped
    lost_log_bytes: int = 0  # message-log bytes found lost below the checkpoint (filed: no message lost)

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


def dispatch_counters(dispatch: DispatcherStatistics) -> SchedulerCounters:
    """A dispatcher's share of the totals."""
    return SchedulerCounters(
        dispatched=dispatch.dispatched,
        dispatch_batches=dispatch.batches,
        dispatch_failures=dispatch.failures,
        damaged_records=dispatch.damaged,
    )


__all__ = ["COUNTERS_DB", "COUNTERS_KEY", "SchedulerCounters", "dispatch_counters"]
