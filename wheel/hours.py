"""Hour wheel: the hours that still hold undelivered messages (docs/architecture.md, "The delay path").

Messages are filed per UTC hour, ``hour = deliver_at // 3_600_000``. A two-year horizon
is at most 17,568 hours, and most of them are usually idle, so the wheel is not an array
of 17,568 slots ticked one by one: it is a sorted set of the non-empty hours. Finding the
next hour to load is one O(log n) lookup however far away it is, so a server with one
message due next year sleeps until then instead of walking through every empty hour.

The hour wheel knows nothing about seconds or messages; the scheduler adds an hour when
it files the first message into it and discards it once the hour is fully dispatched.
It is pure: every method that needs "now" takes it as an argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sortedcontainers import SortedSet

HOUR_MS = 3_600_000
SECOND_MS = 1_000
SECONDS_PER_HOUR = 3_600


class WheelError(ValueError):
    """A wheel was handed something inconsistent; the message names the field and limit."""


def hour_of(epoch_ms: int) -> int:
    """The UTC hour number a ``deliver_at`` (epoch ms) is filed under."""
    return epoch_ms // HOUR_MS


def hour_start_ms(hour: int) -> int:
    """Epoch ms of the first millisecond of ``hour``."""
    return hour * HOUR_MS


def _check_hour(hour: int) -> int:
    if not isinstance(hour, int) or hour < 0:
        raise WheelError(f"hour={hour!r}: must be an int >= 0 (hours since the epoch)")
    return hour


class HourWheel:
    """The sorted set of hours with undelivered messages; idle hours are jumped over."""

    __slots__ = ("_hours",)

    def __init__(self, hours: Iterable[int] = ()) -> None:
        self._hours: SortedSet = SortedSet(_check_hour(h) for h in hours)

    def add(self, hour: int) -> None:
        """Note that ``hour`` holds (or may hold) undelivered messages."""
        self._hours.add(_check_hour(hour))

    def discard(self, hour: int) -> None:
        """Forget ``hour`` (fully dispatched); absent hours are ignored."""
        self._hours.discard(hour)

    def first(self) -> int | None:
        """The earliest hour with undelivered messages, or None."""
        return self._hours[0] if self._hours else None

    def next_after(self, hour: int) -> int | None:
        """The first hour strictly after ``hour``, or None: O(log n) however far."""
        i = self._hours.bisect_right(hour)
        return self._hours[i] if i < len(self._hours) else None

    def hours_between(self, first: int, stop: int) -> list[int]:
        """The hours ``h`` with ``first <= h < stop`` (half-open, like ``range``)."""
        return list(self._hours.irange(first, stop, inclusive=(True, False)))

    def due_hours(self, now_ms: int, lookahead_ms: int) -> list[int]:
        """Hours starting at or before ``now_ms + lookahead_ms``: the ones to load now.

        Includes every overdue hour (all of them, however long the server was down),
        oldest first, so overdue messages go out oldest first.
        """
        if lookahead_ms < 0:
            raise WheelError(f"lookahead_ms={lookahead_ms}: must be >= 0")
        return list(self._hours.irange(maximum=hour_of(now_ms + lookahead_ms)))

    def __len__(self) -> int:
        return len(self._hours)

    def __contains__(self, hour: object) -> bool:
        return hour in self._hours

    def __iter__(self) -> Iterator[int]:
        return iter(self._hours)

    def __repr__(self) -> str:
        return f"HourWheel({list(self._hours)!r})"


__all__ = [
    "HOUR_MS",
    "SECOND_MS",
    "SECONDS_PER_HOUR",
    "HourWheel",
    "WheelError",
    "hour_of",
    "hour_start_ms",
]
