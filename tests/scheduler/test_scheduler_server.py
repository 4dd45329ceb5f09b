"""The scheduler end to end: producer -> scheduler -> realtime -> consumer, all real servers
on an in-memory network under ``autojump_clock`` (see conftest.py), so a message due in
731 days is checked in milliseconds."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.limits import TWO_YEARS_MS
from delaymq.wheel import HOUR_MS

from .conftest import QUIET


async def test_each_message_arrives_at_its_millisecond_never_early_in_order(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster, cluster.scheduler():
        t0 = cluster.clock.now_ms() + 250  # not on a second: deliver_at keeps its milliseconds
        await cluster.clock.sleep_until_ms(t0)
        next_hour = (t0 // HOUR_MS + 1) * HOUR_MS
        delays = {
            "in-1s": 1_000,
            "in-59m59.999s": 3_599_999,
            "on-the-hour": next_hour - t0,
            "in-1h0.5s": 3_600_500,
            "in-30d": 30 * sched.DAY_MS,
            "in-731d": 731 * sched.DAY_MS,
        }
        producer = cluster.producer()
        ids = await producer.send_batch(
            [producer.message("orders", name, id=name, at=t0 + delay) for name, delay in reversed(delays.items())]
        )
        assert sorted(ids) == sorted(delays)
        receiver = cluster.receiver_idle()
        for count, (_name, delay) in enumerate(sorted(delays.items(), key=lambda item: item[1]), start=1):
            # The consumer waits (a long poll) from 5 s before each moment: an early
            # delivery would reach it early.
            await cluster.clock.sleep_until_ms(t0 + delay - 5_000)
            await receiver.receive_until("rt1.test:1", count)
        got = receiver.got
        assert [r.id for r in got] == sorted(delays, key=delays.__getitem__)  # in due order
        for r in got:
            assert r.deliver_at == t0 + delays[r.id]
            assert 0 <= r.received_at - r.deliver_at <= 2, r  # its millisecond, never before


async def test_a_time_in_the_past_is_delivered_at_once_with_the_time_asked_for(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        receiver = cluster.receiver()
        now = cluster.clock.now_ms()
        asked = {"yesterday": now - sched.DAY_MS, "zero": 0, "soon": now + 10}
        answer = await cluster.schedule_raw([sched.message(name, at) for name, at in asked.items()])
        assert answer.metadata["results"] == ["scheduled"] * 3
        got = await receiver.wait_for(3)
        assert {r.id for r in got} == {"yesterday", "zero", "soon"}
        for r in got:
            # A past moment is kept (the consumer sees it was late); 0 ("now") becomes the time of receipt.
            assert r.deliver_at == (now if r.id == "zero" else asked[r.id])
            assert r.received_at - now <= 12
        stats = scheduler.statistics()
        assert stats.rewritten == 2  # due at once
        assert stats.lateness_max_ms >= sched.DAY_MS  # counted as late as it was


async def test_beyond_the_horizon_is_refused_naming_it_and_nothing_is_stored(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        now = cluster.clock.now_ms()
        with pytest.raises(PeerError) as refused:
            await cluster.schedule_raw(
                [sched.message("ok", now + 1_000), sched.message("far", now + 733 * sched.DAY_MS)]
            )
        error = refused.value
        assert (error.code, error.field, error.limit, error.index) == ("limit", "deliver_at", TWO_YEARS_MS, 1)
        assert "horizon" in str(error)
        stats = scheduler.statistics()
        assert (stats.scheduled, stats.message_log_end, stats.pending) == (0, 0, 0)
        # 731 days is inside the horizon.
        answer = await cluster.schedule_raw([sched.message("far-ok", now + 731 * sched.DAY_MS)])
        assert answer.metadata["results"] == ["scheduled"]


async def test_status_reports_tick_and_pending_per_hour(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler():
        now = cluster.clock.now_ms()
        records = [sched.message(f"h{h}-{i}", now + h * HOUR_MS + 5_000 + i) for h in (0, 1, 5) for i in range(h + 2)]
        await cluster.schedule_raw(records)
        receiver = cluster.receiver()
        await receiver.wait_for(2)  # the current hour's two are out
        frame = await cluster.net.call(sched.SCHEDULER, Command.STATUS, {"hours": 10})
        status = frame.metadata
        assert status["group"] == "scheduler-1"
        hours = [(h["name"], h["pending"]) for h in status["hours"]]
        assert hours == [("2025061515", 3), ("2025061519", 7)]
        assert status["statistics"]["pending"] == 10
        assert status["statistics"]["dispatched"] == 2
        tick = status["tick"]
        assert tick["hour"] == "2025061514"  # the current hour: nothing earlier is pending
        assert tick["second"] >= (now + 5_001) // 1000
        with pytest.raises(PeerError) as refused:
            await cluster.net.call(sched.SCHEDULER, Command.STATUS, {"hour": 1})
        assert refused.value.field == "hour"


async def test_cleanup_deletes_filed_segments_and_delivered_hours_past_retention(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    options = {"segment_size": 4096, "retention_ms": 0, "cleanup_interval_ms": 60_000}
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler(**options) as scheduler:
            for batch in range(10):  # several message-log segments
                await cluster.schedule_raw([sched.message(f"m{batch}-{i}", now + 1_000 + i) for i in range(20)])
            await receiver.wait_for(200)
            schedule = tmp_path / "scheduler" / "schedule"
            assert (schedule / "2025061514.log").exists()
            await cluster.clock.sleep_until_ms(now + HOUR_MS + 61_000)  # the hour ended, then cleanup ran
            stats = scheduler.statistics()
            assert stats.deleted_hours == 1 and stats.deleted_segments >= 2
            assert not any(schedule.glob("2025061514.*"))
            segments = sorted((tmp_path / "scheduler" / "messages").glob("0*"))
            assert len(segments) == 1  # the active segment is kept
        async with cluster.scheduler(**options) as restarted:  # nothing to replay or resend
            await cluster.clock.sleep_until_ms(cluster.clock.now_ms() + 60_000)
            assert (restarted.statistics().pending, restarted.statistics().hours) == (0, 0)
        assert len(receiver.got) == 200
