"""Memory stays flat as the scheduled backlog grows (docs/performance.md, "Scheduler memory and the backlog"): what the
scheduler holds is bounded by the hours near now and by one replay step, never by the
number of messages scheduled. Checked through the counts ``statistics()`` reports, not
RSS (noisy)."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import trio

from delaymq.scheduler.server import Scheduler
from delaymq.wheel import HOUR_MS

from .conftest import QUIET

COUNT = 4_000
STEP_BYTES = 16 << 10  # about a hundred records per replay step


def assert_holds_only_the_near_hours(scheduler: Scheduler, per_step: int) -> None:
    stats = scheduler.statistics()
    store = scheduler.store.statistics()
    open_hours = scheduler.wheels.open_hours()
    near = sum(scheduler.store.entries(hour) for hour in open_hours)
    counts = scheduler.wheels.counts()
    assert stats.open_hours == len(open_hours) <= 2  # the current hour, the next within the preload
    assert counts.unloaded + counts.scheduled + counts.in_flight <= near
    assert stats.loaded + stats.buffered + stats.cached_records + stats.delivered_held <= near
    assert store.heads_held == 0  # nothing of the heads stays between replay steps
    assert stats.heads_held_max <= per_step  # one step's seconds, not the backlog's
    assert near < COUNT // 100


async def test_a_month_of_backlog_keeps_only_the_near_hours_in_memory(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(7)
    async with (
        sched.open_cluster(tmp_path, **QUIET) as cluster,
        cluster.scheduler(replay_bytes=STEP_BYTES) as scheduler,
    ):
        now = cluster.clock.now_ms()
        due = sorted(now + rng.randrange(60_000, 30 * sched.DAY_MS) for _ in range(COUNT))
        records = [sched.message(f"m{i}", at) for i, at in enumerate(rng.sample(due, COUNT))]
        for first in range(0, COUNT, 200):
            await cluster.schedule_raw(records[first : first + 200])
        per_step = STEP_BYTES // min(map(len, records)) + 1
        await cluster.clock.sleep_until_ms(now + 1_000)  # replay is done: it never waits for time
        stats = scheduler.statistics()
        assert stats.filed == COUNT and stats.hours >= 700
        assert stats.heads_held_max > 0
        assert_holds_only_the_near_hours(scheduler, per_step)
        # A day on: hours opened and closed one after another, the rest untouched.
        receiver = cluster.receiver()
        later = now + sched.DAY_MS + 30_000
        await cluster.clock.sleep_until_ms(later)
        await receiver.wait_for(sum(1 for at in due if at <= later))
        assert all(r.received_at >= r.deliver_at for r in receiver.got)
        ahead = len({at // HOUR_MS for at in due if at > later})
        assert ahead <= scheduler.statistics().hours <= ahead + 1  # and the current hour
        assert_holds_only_the_near_hours(scheduler, per_step)
