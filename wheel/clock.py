"""The one clock (DESIGN.md section 5).

Everything that reads the time takes a ``Clock``: epoch milliseconds now, and a
sleep until an epoch millisecond. Server code never calls ``time.time()``; tests
pass a ``TrioClock``, which maps trio's clock (and so pytest-trio's
``autojump_clock``) onto an epoch, so a two-year schedule runs in milliseconds.
"""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

import trio


@runtime_checkable
class Clock(Protocol):
    """Epoch milliseconds (UTC) now, and a sleep that never wakes early."""

    def now_ms(self) -> int: ...

    async def sleep_until_ms(self, epoch_ms: int) -> None: ...


class SystemClock:
    """The wall clock, with trio's monotonic clock doing the sleeping."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        # Sleep on trio's clock, then re-check the wall clock: the two drift
        # apart (NTP slews, suspend), and waking early is the one thing a delay
        # queue must never do.
        while True:
            remaining = epoch_ms - self.now_ms()
            if remaining <= 0:
                return
            await trio.sleep(remaining / 1000)


class TrioClock:
    """Epoch time driven by trio's clock: ``now = epoch_ms + trio time elapsed``.

    Build it inside a trio run. With ``autojump_clock`` every idle moment jumps
    the clock to the next deadline, so long waits cost nothing in a test.
    """

    def __init__(self, epoch_ms: int) -> None:
        self._epoch_ms = epoch_ms
        self._trio_start = trio.current_time()

    def now_ms(self) -> int:
        return self._epoch_ms + math.floor((trio.current_time() - self._trio_start) * 1000)

    async def sleep_until_ms(self, epoch_ms: int) -> None:
        # Ceil so the wake-up lands on or after the target millisecond.
        deadline = self._trio_start + (epoch_ms - self._epoch_ms) / 1000
        await trio.sleep_until(deadline)
        while self.now_ms() < epoch_ms:  # float rounding: step to the next ms
            await trio.sleep(0.0005)


__all__ = ["Clock", "SystemClock", "TrioClock"]
