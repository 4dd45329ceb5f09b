"""The dispatcher's confirmer: records what realtime accepted in the hours' dispatch logs.

One thread call and one fsync per round; while more is on the way, rounds start at least
``confirm_interval_ms`` apart, so one round covers the SENDs accepted meanwhile. Only once
a round is durable are its entries marked done in the wheel, which moves the tick and
frees the memory budget.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from delaymq.clock import Alarm
from delaymq.scheduler.dispatchcontext import DispatchContext
from delaymq.scheduler.schedulelog import ScheduleStore


class ConfirmItem(NamedTuple):
    """One accepted entry of an hour, waiting for its dispatch-log round."""

    deliver_at: int
    entry: int


class Confirmer:
    """The confirmer task (``run``): accepted entries wait in ``pending`` for its next round."""

    def __init__(
        self,
        context: DispatchContext,
        *,
        confirm_interval_ms: int,
        on_recorded: Callable[[dict[int, list[int]]], None] | None,
        settle: Callable[[], None],
        more_coming: Callable[[], bool],
    ) -> None:
        self._store = context.store
        self._wheels = context.wheels
        self._clock = clock = context.clock
        self._run_blocking = context.run_blocking
        self._load_alarm = context.load_alarm  # poked when an hour may close or memory was freed
        self._interval_ms = confirm_interval_ms
        #: Told of each round once it is durable: hour -> entry numbers (replication).
        self._on_recorded = on_recorded
        #: Called after each round: nothing may be on the way any more (``Dispatcher.drain``).
        self._settle = settle
        #: Whether records wait in lanes and firing goes on: worth gathering them in one round.
        self._more_coming = more_coming
        #: Hour -> entries accepted by realtime, not yet in a round.
        self.pending: dict[int, list[ConfirmItem]] = {}
        self.confirming = False  # a round is being written
        self._alarm = Alarm(clock)
        #: The pause between rounds: poked when nothing is on the way.
        self._gather_alarm = Alarm(clock)
        self._gathering = False
        self.rounds = 0
        self.recorded = 0  # entries newly written to dispatch logs

    def accepted(self, all_accepted: bool) -> None:
        """Realtime accepted more (now in ``pending``); ``all_accepted``: nothing else waits in a lane."""
        self._alarm.poke()
        if all_accepted and self._gathering:
            self._gather_alarm.poke()  # everything fired is accepted: no need to wait for more

    def hurry(self) -> None:
        """Start a round now, without gathering: no more is coming (a drain)."""
        self._alarm.poke()
        if self._gathering:
            self._gather_alarm.poke()

    async def run(self) -> None:
        while True:
            await self._alarm.wait(None)
            while self.pending:
                started = self._clock.monotonic_ms()
                await self._round()
                # More on its way: what realtime accepts meanwhile waits for the next round.
                rest = self._interval_ms - (self._clock.monotonic_ms() - started)
                if rest > 0 and self._more_coming():
                    self._gathering = True
                    try:
                        await self._gather_alarm.wait_ms(rest)
                    finally:
                        self._gathering = False

    async def _round(self) -> None:
        """Write what is pending to the dispatch logs, then mark it done in the wheels."""
        batch, self.pending = self.pending, {}
        self.rounds += 1
        self.confirming = True
        try:
            self.recorded += await self._run_blocking(partial(_record, self._store, batch))
        finally:
            self.confirming = False
        if self._on_recorded is not None:
            self._on_recorded({hour: [entry for _at, entry in items] for hour, items in batch.items()})
        wheels = self._wheels
        finished = False
        for hour, items in batch.items():
            wheels.confirm(hour, items)
            wheel = wheels.wheel(hour)
            finished = finished or (wheel is not None and wheel.is_done())
        if finished or wheels.short_of_budget:
            self._load_alarm.poke()  # an hour to close, or memory freed for loads that wait
        self._settle()


def _record(store: ScheduleStore, batch: dict[int, list[ConfirmItem]]) -> int:
    """Append accepted entries to their dispatch logs and fsync them: one round (in a thread)."""
    new = 0
    for hour, items in batch.items():
        new += store.record_dispatched(hour, [entry for _at, entry in items])
    store.flush_dispatched()
    return new


__all__ = ["ConfirmItem", "Confirmer"]
