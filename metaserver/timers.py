"""The metaserver's time: the steady time the registry is fed, and the expiry task that
wakes for evictions and failovers so they happen, are written and are logged on time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from delaymq.clock import Clock
from delaymq.metaserver.event_log import RegistryEventLog
from delaymq.metaserver.registry import Registry


class SteadyTime:
    """The registry's time: the wall clock at start, moved on by the monotonic clock only,
    so a wall-clock step neither evicts every server (a step forward) nor keeps dead ones
    routed (a step back)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._origin = clock.now_ms() - clock.monotonic_ms()

    def now_ms(self) -> int:
        """Epoch ms at start, moved on by the monotonic clock since."""
        return self._origin + self._clock.monotonic_ms()


class ExpiryTimer:
    """Expires the registry every ``check_interval_ms``, and sooner when a managed server
    group's failover falls due, writing and logging what that changed."""

    def __init__(
        self,
        registry: Registry,
        clock: Clock,
        steady: SteadyTime,
        *,
        check_interval_ms: int,
        persist: Callable[[], Awaitable[None]],
        event_log: RegistryEventLog,
    ) -> None:
        self._registry = registry
        self._clock = clock
        self._steady = steady
        self._check_interval_ms = check_interval_ms
        self._persist = persist
        self._event_log = event_log
        # The running sleep, cancelled when a failover falls due before it ends.
        self._sleep: trio.CancelScope | None = None
        self._wake_ms = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: sleep to the next check or deadline, then expire, write and log."""
        task_status.started()
        while True:
            now = self._steady.now_ms()
            wake = now + self._check_interval_ms
            deadline = self._registry.next_deadline_ms
            if deadline is not None:
                wake = min(wake, max(deadline, now))
            with trio.CancelScope() as sleep:
                self._sleep, self._wake_ms = sleep, wake
                await self._clock.sleep_ms(wake - now)
            self._sleep = None
            now = self._steady.now_ms()
            self._registry.expire(now)
            await self._persist()
            self._event_log.notice(now, always=True)

    def wake_if_due(self) -> None:
        """Cut the sleep short if a failover falls due before it ends (a request may set one)."""
        if self._sleep is None:
            return
        deadline = self._registry.next_deadline_ms
        if deadline is not None and deadline < self._wake_ms:
            self._sleep.cancel()


__all__ = ["ExpiryTimer", "SteadyTime"]
