"""What the dispatcher's loader, firer, lanes and confirmer share (one event loop, no locks)."""

from __future__ import annotations

from dataclasses import dataclass

from delaymq.clock import AheadClock, Alarm, Clock
from delaymq.scheduler.readahead import ReadAhead
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.threads import RunBlocking


@dataclass(frozen=True, slots=True)
class DispatchContext:
    store: ScheduleStore
    wheels: WheelSet  # the pure rules of what to open, load and fire next
    #: What the loader, firer and lanes run on: the wall clock read ``send_ahead_ms`` early.
    clock: Clock
    #: The wall clock, for what is measured against ``deliver_at`` (lateness).
    wall: Clock
    run_blocking: RunBlocking  # every disk read or write goes through it (a worker thread)
    read_ahead: ReadAhead
    load_alarm: Alarm  # wakes the loader: an hour to open or close, a second to load
    fire_alarm: Alarm  # wakes the firer: something new may be due

    @classmethod
    def build(
        cls,
        *,
        store: ScheduleStore,
        wheels: WheelSet,
        wall: Clock,
        send_ahead_ms: int,
        run_blocking: RunBlocking,
        max_cached_bytes: int,
    ) -> DispatchContext:
        clock = AheadClock(wall, send_ahead_ms) if send_ahead_ms else wall
        return cls(
            store=store,
            wheels=wheels,
            clock=clock,
            wall=wall,
            run_blocking=run_blocking,
            read_ahead=ReadAhead(max_cached_bytes),
            load_alarm=Alarm(clock),
            fire_alarm=Alarm(clock),
        )


__all__ = ["DispatchContext"]
