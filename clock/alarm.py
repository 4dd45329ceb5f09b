"""Alarm: sleep until an epoch millisecond, or until poked, whichever comes first.

The dispatcher's tasks sleep until their next non-empty moment (never a busy tick
loop); something that may make that moment earlier (an arrival, a loaded second, a
confirmation) pokes them and they work out the moment again. A poke while the task
is awake is remembered, so no poke is lost between computing a deadline and
sleeping until it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio

from delaymq.clock.clocks import Clock


class Alarm:
    """One sleeper's wake-up: ``wait(deadline_ms)`` (a wall moment) or ``wait_ms(duration)``
    (an interval) returns then or on ``poke``."""

    __slots__ = ("_clock", "_poked", "_scope", "pokes")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._poked = False
        self._scope: trio.CancelScope | None = None
        self.pokes = 0

    def poke(self) -> None:
        """Wake the sleeper now (or make its next ``wait`` return at once)."""
        self._poked = True
        self.pokes += 1
        if self._scope is not None:
            self._scope.cancel()

    async def wait(self, deadline_ms: int | None) -> None:
        """Sleep until the wall clock reads ``deadline_ms`` (epoch ms; None: no deadline)
        or a poke."""
        await self._sleep(None if deadline_ms is None else partial(self._clock.sleep_until_ms, deadline_ms))

    async def wait_ms(self, duration_ms: int) -> None:
        """Sleep ``duration_ms`` of the monotonic clock (an interval, which a wall-clock
        step must not stretch) or until a poke."""
        await self._sleep(partial(self._clock.sleep_ms, duration_ms))

    async def _sleep(self, sleeper: Callable[[], Awaitable[None]] | None) -> None:
        if self._poked:
            self._poked = False
            await trio.lowlevel.checkpoint()
            return
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                if sleeper is None:
                    await trio.sleep_forever()
                else:
                    await sleeper()
            finally:
                self._scope = None
        self._poked = False


__all__ = ["Alarm"]
