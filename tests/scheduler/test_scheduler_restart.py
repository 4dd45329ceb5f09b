"""Restarts: the scheduler is killed and started again on its data folder.

How it is killed: ``Scheduler.crash()`` cancels every task of the scheduler where it
waits (and the ``async with`` block around it) and closes its files without writing
anything more: no replay step, no dispatch-log record, no checkpoint, as after a
SIGKILL (page-cache contents survive a killed process, and those are what the next
open reads). Every server is real; the network is in memory, under ``autojump_clock``.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import trio

from delaymq.protocol.frames import Frame
from delaymq.wheel import HOUR_MS

MINUTE = 60_000


async def test_killed_then_restarted_three_hours_later_delivers_overdue_at_once_and_the_rest_on_time(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        clock = cluster.clock
        t0 = clock.now_ms()  # 14:00 UTC
        hour = t0 // HOUR_MS * HOUR_MS
        plan = {
            "a-before-crash": hour + 5 * MINUTE,
            "b-loaded-at-crash": hour + 10 * MINUTE + 2_000,  # read ahead (3 s) when the crash comes
            "c-this-hour": hour + 30 * MINUTE,
            "d-next-hour": hour + HOUR_MS + 20 * MINUTE,
            "e-3h-overdue": hour + 3 * HOUR_MS + 5 * MINUTE,
            "f-3h-on-time": hour + 3 * HOUR_MS + 40 * MINUTE,
        }
        records = [sched.message(f"{name}-{i}", at + i) for name, at in plan.items() for i in range(3)]
        crash_at = hour + 10 * MINUTE
        restart_at = crash_at + 3 * HOUR_MS  # 17:10
        receiver = cluster.receiver()
        async with cluster.scheduler() as scheduler:
            await cluster.schedule_raw(records[::-1])
            await receiver.wait_for(3)
            await clock.sleep_until_ms(crash_at)
            assert scheduler.statistics().loaded == 3  # b's second is read ahead
            scheduler.crash()
            await trio.sleep_forever()  # cancelled by the crash, as the process would be
        assert scheduler.crashed
        await clock.sleep_until_ms(restart_at)
        assert len(receiver.got) == 3  # nothing moved while it was down
        async with cluster.scheduler() as restarted:
            assert restarted.statistics().pending == 15
            await receiver.wait_for(18)
            stats = restarted.statistics()
        got = receiver.got
        assert max(Counter(r.id for r in got).values()) == 1  # none twice
        assert cluster.realtime["rt1"].statistics().duplicates == 0  # and none sent twice
        assert [r.id for r in got] == [r.id for r in sorted(got, key=lambda r: r.deliver_at)]  # oldest first
        for r in got:
            name = r.id.rsplit("-", 1)[0]
            if plan[name] < crash_at or plan[name] > restart_at:
                assert 0 <= r.received_at - r.deliver_at <= 2, r  # on time
            else:
                assert 0 <= r.received_at - restart_at <= 2, r  # overdue: at once on restart
        assert stats.dispatched == 3 + 15 and stats.pending == 0  # counters are totals: they survive the crash


async def test_killed_between_a_dispatch_and_its_dispatch_log_record_the_consumer_sees_it_once(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler() as scheduler:
            await cluster.schedule_raw([sched.message("first", now + 1_000), sched.message("second", now + 2_000)])

            async def kill_after_realtime_accepted(address: str, answer: Frame) -> None:
                cluster.net.after_send = None
                assert answer.metadata["results"] == ["stored"]
                scheduler.crash()  # realtime has it; the dispatch log never will
                await trio.sleep_forever()

            cluster.net.after_send = kill_after_realtime_accepted
            await trio.sleep_forever()
        assert scheduler.crashed
        assert (await receiver.wait_for(1))[0].id == "first"
        assert scheduler.statistics().dispatched == 0
        async with cluster.scheduler() as restarted:
            await receiver.wait_for(2)
            await cluster.clock.sleep_until_ms(now + 10_000)
            stats = restarted.statistics()
        assert receiver.ids() == ["first", "second"]
        assert stats.dispatched == 2  # "first" was sent again...
        assert cluster.realtime["rt1"].statistics().duplicates == 1  # ...and dropped by realtime's dedup
