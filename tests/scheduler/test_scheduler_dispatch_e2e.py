"""Dispatch end to end: a realtime outage, and 100,000 messages due in one second.

Real servers on an in-memory network under ``autojump_clock`` (see conftest.py).
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import trio

from delaymq.realtime.index import RELEASE_TICK_MS

SECOND = 1_000


async def test_while_realtime_is_down_messages_wait_then_all_arrive_in_order(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        t0 = clock.now_ms()
        due = {f"m{i:02d}": t0 + 10 * SECOND + i * SECOND for i in range(50)}  # due from t0+10 s to t0+59 s
        await cluster.schedule_raw([sched.message(name, at) for name, at in due.items()])
        receiver = cluster.receiver()
        await clock.sleep_until_ms(t0 + 5 * SECOND)
        cluster.stop_realtime("rt1")
        await clock.sleep_until_ms(t0 + 90 * SECOND)  # long enough for the metaserver to evict it
        stats = scheduler.statistics()
        assert stats.dispatched == 0 and stats.in_outage and stats.dispatch_failures >= 2
        assert stats.pending == 50 and stats.waiting == 50  # fired, held, not dropped
        assert scheduler.statistics().tick.second == (t0 + 10 * SECOND) // SECOND  # the wheel kept its place
        back = clock.now_ms()
        await cluster.start_realtime("rt1")
        got = await receiver.wait_for(50)
        assert [r.id for r in got] == list(due)  # none lost, none twice, in order
        assert all(r.received_at >= back for r in got)
        assert max(r.received_at for r in got) - back <= 6 * SECOND  # within the capped backoff
        stats = scheduler.statistics()
        assert stats.dispatched == 50 and stats.pending == 0 and not stats.in_outage


async def test_100_000_messages_in_one_second_fire_in_that_second_in_order(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    count = 100_000
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        second = (clock.now_ms() // SECOND + 30) * SECOND
        order = list(range(count))
        random.Random(7).shuffle(order)  # filed out of order; the wheel sorts by millisecond
        records = [sched.message(f"m{n:06d}", second + n * SECOND // count) for n in order]
        for start in range(0, count, 20_000):
            await cluster.schedule_raw(records[start : start + 20_000])
        receiver = cluster.receiver()
        got = await receiver.wait_for(count)
        assert len(got) == count
        assert all(second <= r.deliver_at <= r.received_at < second + SECOND for r in got)
        filed = {n: position for position, n in enumerate(order)}
        expected = sorted(range(count), key=lambda n: (second + n * SECOND // count, filed[n]))
        assert [r.id for r in got] == [f"m{n:06d}" for n in expected]
        stats = scheduler.statistics()
        assert stats.dispatched == count and stats.lateness_max_ms <= 2


async def test_sent_ahead_each_message_reaches_the_consumer_at_its_tick_never_early_in_order(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """With ``send_ahead_ms`` realtime holds what comes ahead of time: 2,000 messages over
    two seconds arrive in their order, none before its ``deliver_at``, each by the release
    tick after it, in about one SEND per send interval."""
    async with sched.open_cluster(tmp_path) as cluster:
        async with cluster.scheduler(send_ahead_ms=50, send_interval_ms=20) as scheduler:
            clock = cluster.clock
            start = (clock.now_ms() // SECOND + 10) * SECOND
            due = {f"m{n:04d}": start + n for n in range(2_000)}
            await cluster.schedule_raw([sched.message(name, at) for name, at in due.items()])
            receiver = cluster.receiver()
            got = await receiver.wait_for(len(due))
            stats = scheduler.statistics()
    assert [r.id for r in got] == list(due)
    assert all(r.deliver_at <= r.received_at < r.deliver_at + RELEASE_TICK_MS for r in got)
    assert stats.dispatch_batches <= 2_000 // 20 + 5  # about one SEND per send interval
