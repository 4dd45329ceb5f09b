"""The one clock (docs/architecture.md, "Code rules").

Everything that reads the time takes a ``Clock``. It has two readings, kept apart
on purpose:

- the **wall clock** (``now_ms``, ``sleep_until_ms``): epoch milliseconds (UTC),
  for moments a user named (a message's ``deliver_at``) and timestamps. It can
  step: an admin or NTP sets it back or forward. A wait for a wall moment
  therefore looks at the wall clock again every ``WALL_RECHECK_MS`` (``SystemClock``)
  or whenever it is stepped (``TrioClock``), so a step, or a step and its
  correction, is followed within a second; it never wakes before the moment.
- the **monotonic clock** (``monotonic_ms``, ``sleep_ms``): for intervals
  (heartbeats, timeouts, backoffs, evictions). It never steps, so a wall-clock
  step neither freezes nor rushes them.

A step of more than ``STEP_WARN_MS`` (the wall clock moving against the
monotonic one between two readings) is logged once as a warning.

Server code never calls ``time.time()``; tests pass a ``TrioClock``, which maps
trio's clock (and so pytest-trio's ``autojump_clock``) onto an epoch, so a
two-year schedule runs in milliseconds, and whose wall reading ``step``s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import trio

log = logging.getLogger(__name__)

#: A wall-clock move against the monotonic clock beyond this is a step, and is logged.
STEP_WARN_MS = 1_000
#: The longest a wait for a wall moment goes without looking at the wall clock again
#: (half a second: a step is followed well within a second; two cheap wake-ups a second).
WALL_RECHECK_MS = 500


@runtime_checkable
class Clock(Protocol):
    """Wall-clock moments (which may step) and monotonic intervals (which never do)."""

    def now_ms(self) -> int:
        """Epoch milliseconds (UTC) by the wall clock."""
        ...

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        """Return once the wall clock reads ``epoch_ms`` or later: never early, and
        within about a second of it reading so however the wall clock stepped."""
        ...

    def monotonic_ms(self) -> int:
        """Milliseconds on a clock that never steps (arbitrary origin): for intervals."""
        ...

    async def sleep_ms(self, duration_ms: float) -> None:
        """Sleep an interval of the monotonic clock (a wall-clock step changes nothing)."""
        ...


class StepWatch:
    """Notices the wall clock stepping against the monotonic clock; logs each step once.

    Fed pairs of readings; the offset between them moves by a step (slewing moves
    it by under a millisecond per second, so it is not mistaken for one).
    """

    __slots__ = ("_offset", "steps", "threshold_ms")

    def __init__(self, *, threshold_ms: int = STEP_WARN_MS) -> None:
        self.threshold_ms = threshold_ms
        self._offset: int | None = None
        self.steps = 0

    def observe(self, wall_ms: int, monotonic_ms: int) -> int:
        """The step (ms, negative: back) since the previous reading, or 0."""
        offset = wall_ms - monotonic_ms
        previous, self._offset = self._offset, offset
        if previous is None:
            return 0
        step = offset - previous
        if abs(step) <= self.threshold_ms:
            return 0
        self.steps += 1
        log.warning(
            "the wall clock stepped %s by %.1f s; waits for a moment follow the new wall clock "
            "(a message is never delivered before its deliver_at by it), intervals are not affected",
            "back" if step < 0 else "forward",
            abs(step) / 1000,
        )
        return step


class SystemClock:
    """The wall clock, with trio's monotonic clock doing the sleeping.

    ``wall_ns`` and ``monotonic_ns`` replace ``time.time_ns`` and
    ``time.monotonic_ns`` (tests step a fake wall clock with them).
    """

    def __init__(
        self,
        *,
        wall_ns: Callable[[], int] | None = None,
        monotonic_ns: Callable[[], int] | None = None,
    ) -> None:
        self._wall_ns = wall_ns
        self._monotonic_ns = monotonic_ns
        self.step_watch = StepWatch()
        self._observed = -1  # the last reading the step watch saw
        self.now_ms()  # the first reading: a step from here on is noticed

    def now_ms(self) -> int:
        # Looked up at each call (not bound at import), so freezegun's patches apply.
        wall = (time.time_ns() if self._wall_ns is None else self._wall_ns()) // 1_000_000
        if wall != self._observed:
            # A reading equal to the last one adds nothing to compare (a step shows at the
            # next new reading, a millisecond later at most): a producer reads the clock for
            # each message, many times a millisecond, at half the cost.
            self._observed = wall
            self.step_watch.observe(wall, self.monotonic_ms())
        return wall

    def monotonic_ms(self) -> int:
        return (time.monotonic_ns() if self._monotonic_ns is None else self._monotonic_ns()) // 1_000_000

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        # Sleep on the monotonic clock in slices of at most WALL_RECHECK_MS, looking at
        # the wall clock after each: a step back then forward (or a step forward) is
        # followed within a second, and waking early is the one thing a delay queue
        # must never do.
        while True:
            remaining = epoch_ms - self.now_ms()
            if remaining <= 0:
                return
            await trio.sleep(min(remaining, WALL_RECHECK_MS) / 1000)

    async def sleep_ms(self, duration_ms: float) -> None:
        await trio.sleep(max(0.0, duration_ms) / 1000)


class TrioClock:
    """Epoch time driven by trio's clock: ``now = epoch_ms + trio time elapsed``.

    Build it inside a trio run. With ``autojump_clock`` every idle moment jumps
    the clock to the next deadline, so long waits cost nothing in a test.
    ``step(ms)`` moves the wall reading as an admin setting the clock would;
    trio's (monotonic) clock goes on undisturbed, and sleepers waiting for a wall
    moment look again at once.
    """

    def __init__(self, epoch_ms: int) -> None:
        self._epoch_ms = epoch_ms
        self._trio_start = trio.current_time()
        self._stepped = trio.Event()
        self.step_watch = StepWatch()
        self.now_ms()  # the first reading: a step from here on is noticed

    def now_ms(self) -> int:
        wall = self._epoch_ms + math.floor((trio.current_time() - self._trio_start) * 1000)
        self.step_watch.observe(wall, self.monotonic_ms())
        return wall

    def monotonic_ms(self) -> int:
        return math.floor((trio.current_time() - self._trio_start) * 1000)

    def step(self, delta_ms: int) -> None:
        """Step the wall clock by ``delta_ms`` (negative: back); wake wall-moment sleepers."""
        self._epoch_ms += delta_ms
        self._stepped.set()
        self._stepped = trio.Event()

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        while self.now_ms() < epoch_ms:
            deadline = self._trio_start + (epoch_ms - self._epoch_ms) / 1000
            if deadline <= trio.current_time():  # float rounding: step to the next ms
                deadline = trio.current_time() + 0.0005
            with trio.move_on_at(deadline):
                await self._stepped.wait()
        await trio.lowlevel.checkpoint()

    async def sleep_ms(self, duration_ms: float) -> None:
        await trio.sleep(max(0.0, duration_ms) / 1000)


class AheadClock:
    """``clock`` read ``ahead_ms`` early: every wall moment comes that much sooner.

    The scheduler's firer runs on one to send messages ahead of their ``deliver_at``
    (realtime holds each until then), so a SEND's round trip and the firer's own
    delays are spent before the moment, not after it. Intervals are ``clock``'s.
    """

    def __init__(self, clock: Clock, ahead_ms: int) -> None:
        if ahead_ms < 0:
            raise ValueError(f"ahead_ms must be at least 0, got {ahead_ms}")
        self.clock = clock
        self.ahead_ms = ahead_ms

    def now_ms(self) -> int:
        return self.clock.now_ms() + self.ahead_ms

    def monotonic_ms(self) -> int:
        return self.clock.monotonic_ms()

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        await self.clock.sleep_until_ms(epoch_ms - self.ahead_ms)

    async def sleep_ms(self, duration_ms: float) -> None:
        await self.clock.sleep_ms(duration_ms)


__all__ = ["STEP_WARN_MS", "WALL_RECHECK_MS", "AheadClock", "Clock", "StepWatch", "SystemClock", "TrioClock"]
