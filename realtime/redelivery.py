"""The redelivery sweep: give back what consumers took and did not ack in time.

``Groups`` keeps the deadlines in order (a hand-out's ack timeout, a consumer's
timeout since its last sign of life); ``RedeliverySweeper`` sleeps until the
earliest one, never on a periodic tick, and wakes the pulls parked on the
subjects that got messages back. A sweep happens at most every ``step`` ms (a
twentieth of the shorter timeout), so a burst of deadlines costs one pass.
Whatever may move a deadline earlier (a new consumer, a pull, an ack) pokes the
sweeper.
"""

from __future__ import annotations

import math

import trio

from delaymq.clock import Clock
from delaymq.realtime.groups import Groups
from delaymq.realtime.parked import ParkedPulls


class RedeliverySweeper:
    """Expires hand-outs and consumers at their deadlines; run it in a nursery with ``run``."""

    def __init__(self, *, groups: Groups, clock: Clock, parked: ParkedPulls) -> None:
        self._groups = groups
        self._clock = clock
        self._parked = parked
        self._wakeup = trio.Event()
        self._scope: trio.CancelScope | None = None
        self._sleeping_for = math.inf  # the deadline the sweeper sleeps for
        self.step = max(1, min(groups.ack_timeout_ms, groups.consumer_timeout_ms) // 20)

    def poke(self) -> None:
        """A deadline may now be earlier than the one the sweeper sleeps to."""
        if self._scope is None:
            self._wakeup.set()
            return
        deadline = self._groups.next_deadline()
        if deadline is not None and deadline < self._sleeping_for:
            self._scope.cancel()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Give back what timed out, at the earliest deadline (at most every ``step`` ms)."""
        task_status.started()
        last = -math.inf
        groups = self._groups
        while True:
            deadline = groups.next_deadline()
            if deadline is None:
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            target = int(max(deadline, last + self.step))
            with trio.CancelScope() as scope:
                self._scope = scope
                self._sleeping_for = deadline
                await self._clock.sleep_ms(target - self._clock.monotonic_ms())
            self._scope = None
            self._sleeping_for = math.inf
            if scope.cancelled_caught:
                continue
            now = self._clock.monotonic_ms()
            last = now
            self._parked.wake([share.subject for share in groups.expire(now)])


__all__ = ["RedeliverySweeper"]
