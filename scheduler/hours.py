"""UTC hours of the schedule storage: numbers, file names, limits and errors.

An hour is ``deliver_at // 3_600_000`` (hours since the epoch, UTC), the same number
``delaymq.wheel.hour_of`` gives. On disk an hour is named ``YYYYMMDDHH`` in UTC, so a
listing sorts by time and an operator can read it. Converting a number to a name is
arithmetic on an epoch value, never a reading of the clock and never local time.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from delaymq.storage.errors import CorruptLog, StorageError
from delaymq.wheel.hours import HOUR_MS, SECOND_MS, SECONDS_PER_HOUR

#: The last hour a ``YYYYMMDDHH`` name can hold: 9999-12-31 23:00 UTC.
MAX_HOUR = 70_389_527  # (datetime(9999, 12, 31, 23, tzinfo=utc) - epoch) // 1 h
#: The latest deliver_at the schedule storage can file.
MAX_DELIVER_AT = (MAX_HOUR + 1) * HOUR_MS - 1
#: An hour's files: ``YYYYMMDDHH`` + one of these.
LOG_SUFFIX = ".log"  # the schedule log
INDEX_SUFFIX = ".index"  # the delay index
DISPATCH_SUFFIX = ".dispatch"  # the dispatch log
HEADS_SUFFIX = ".heads"  # the second-heads table
#: How long a fully dispatched hour is kept before it may be deleted.
DEFAULT_RETENTION_MS = 72 * HOUR_MS

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAME = re.compile(r"^[0-9]{10}$")


class ScheduleError(StorageError):
    """Base of the errors of the schedule storage (schedule logs, index, dispatch logs)."""


class HourOutOfRange(ScheduleError):
    """A deliver_at (or hour number) outside what the schedule storage can file."""


class CorruptSchedule(ScheduleError, CorruptLog):
    """A schedule file does not check where recovery must not guess."""


class ReplayGap(ScheduleError):
    """Replay must read message-log records that were already deleted."""


class HourNotComplete(ScheduleError):
    """``delete_hour`` of an hour that still has undelivered entries."""


def check_hour(hour: int) -> int:
    """``hour`` if it can be named on disk; ``HourOutOfRange`` naming the limit otherwise."""
    if type(hour) is not int or not 0 <= hour <= MAX_HOUR:
        raise HourOutOfRange(f"hour={hour!r}: must be an int from 0 to {MAX_HOUR} (9999-12-31 23h UTC)")
    return hour


def hour_name(hour: int) -> str:
    """``YYYYMMDDHH`` (UTC) of an hour number: ``hour_name(0) == "1970010100"``."""
    moment = _EPOCH + timedelta(hours=check_hour(hour))
    return f"{moment.year:04d}{moment.month:02d}{moment.day:02d}{moment.hour:02d}"


def parse_hour_name(name: str) -> int:
    """The hour number of a ``YYYYMMDDHH`` name; ``ValueError`` if it is not one."""
    if not _NAME.match(name):
        raise ValueError(f"hour name {name!r} is not YYYYMMDDHH")
    moment = datetime(int(name[0:4]), int(name[4:6]), int(name[6:8]), int(name[8:10]), tzinfo=UTC)
    hour = (moment - _EPOCH) // timedelta(hours=1)
    return check_hour(hour)


__all__ = [
    "DEFAULT_RETENTION_MS",
    "DISPATCH_SUFFIX",
    "HEADS_SUFFIX",
    "INDEX_SUFFIX",
    "LOG_SUFFIX",
    "HOUR_MS",
    "MAX_DELIVER_AT",
    "MAX_HOUR",
    "SECONDS_PER_HOUR",
    "SECOND_MS",
    "CorruptSchedule",
    "HourNotComplete",
    "HourOutOfRange",
    "ReplayGap",
    "ScheduleError",
    "check_hour",
    "hour_name",
    "parse_hour_name",
]
