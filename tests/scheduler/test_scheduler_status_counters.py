"""Status: what a scheduler has not yet filed, and counters that survive a restart.

STATUS says how many bytes and records lie between the replay checkpoint and the end of
the message log, so "is filing done" has a plain answer, and its counters (scheduled,
rewritten, filed, dispatched, ...) are totals since the data folder was created: saved
in the lmdb state, loaded at start, kept across a stop and a kill. ``delaymq status``
shows both (its renderer is checked on the same answers). Real servers on an in-memory
network under ``autojump_clock``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.cli.status_command import format_scheduler
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.scheduler import schedule as schedule_module
from delaymq.scheduler.replay import Unfiled, replay_step, unfiled
from delaymq.wheel import HOUR_MS

COUNTERS = (
    "schedule_requests",
    "scheduled",
    "rewritten",
    "filed",
    "dispatched",
    "dispatch_batches",
    "dispatch_failures",
    "deleted_hours",
    "deleted_segments",
)


async def status(cluster: Any, sched: SimpleNamespace) -> dict[str, Any]:
    frame = await cluster.net.call(sched.SCHEDULER, Command.STATUS, {})
    answer: dict[str, Any] = frame.metadata
    return answer


def counters(answer: dict[str, Any]) -> dict[str, int]:
    return {name: answer["statistics"][name] for name in COUNTERS}


async def test_status_says_how_many_records_and_bytes_are_not_yet_filed(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler(flush="async"):
        now = cluster.clock.now_ms()
        records = [sched.message(f"m{i}", now + HOUR_MS + i) for i in range(1_000)]
        await cluster.schedule_raw(records)
        # Under flush=async the answer comes before the fsync, and replay files only what is durable.
        waiting = await status(cluster, sched)
        stats = waiting["statistics"]
        assert (stats["unfiled_records"], stats["unfiled_bytes"], stats["unfiled_exact"]) == (
            1_000,
            sum(map(len, records)),
            True,
        )
        assert stats["scheduled"] == 1_000 and stats["filed"] == 0
        await cluster.clock.sleep_ms(1_000)  # the next fsync, then replay
        done = await status(cluster, sched)
        assert (done["statistics"]["unfiled_records"], done["statistics"]["unfiled_bytes"]) == (0, 0)
        assert done["statistics"]["filed"] == 1_000
    shown = format_scheduler("scheduler-1", sched.SCHEDULER, waiting)
    assert f"NOT YET FILED: 1000 record(s), {sum(map(len, records))} bytes" in shown
    assert "filing done" in format_scheduler("scheduler-1", sched.SCHEDULER, done)


async def test_a_schedule_waits_while_filing_is_too_far_behind_then_is_stored(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Producers faster than filing: what is accepted and not filed stays bounded
    (``max_unfiled_bytes``): the next SCHEDULE is answered once replay caught up."""
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        batches = [[sched.message(f"b{b}m{i}", now + HOUR_MS + i) for i in range(100)] for b in range(2)]
        size = sum(map(len, batches[0]))
        async with cluster.scheduler(flush="async", max_unfiled_bytes=size - 1) as scheduler:
            started = trio.current_time()
            await cluster.schedule_raw(batches[0])  # answered before its fsync: unfiled, past the bound
            assert trio.current_time() == started and scheduler.statistics().unfiled_bytes == size
            await cluster.schedule_raw(batches[1])  # waits for the fsync and replay of the first
            stats = scheduler.statistics()
            assert trio.current_time() > started and stats.schedule_waits == 1
            assert stats.filed >= 100 and stats.unfiled_bytes == size and stats.scheduled == 200
            shown = format_scheduler("scheduler-1", sched.SCHEDULER, await status(cluster, sched))
            assert "1 SCHEDULE(s) waited for filing to catch up since start" in shown


async def test_a_schedule_that_waited_too_long_for_filing_is_refused_retryable_and_nothing_is_stored(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: Any
) -> None:
    monkeypatch.setattr(schedule_module, "FILING_WAIT_MS", 50)  # less than async flush's interval
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        first = [sched.message(f"a{i}", now + HOUR_MS + i) for i in range(100)]
        second = [sched.message(f"b{i}", now + HOUR_MS + i) for i in range(100)]
        async with cluster.scheduler(flush="async", max_unfiled_bytes=sum(map(len, first)) - 1) as scheduler:
            await cluster.schedule_raw(first)
            end = scheduler.statistics().message_log_end
            with pytest.raises(PeerError) as refused:
                await cluster.schedule_raw(second)
            assert refused.value.code == "unavailable" and refused.value.field == "max_unfiled_bytes"
            assert scheduler.statistics().message_log_end == end  # nothing of it stored
            while scheduler.statistics().unfiled_bytes:  # the fsync, then replay
                await trio.sleep(0.1)
            answer = await cluster.schedule_raw(second)  # the retry is stored
            assert answer.metadata["results"] == ["scheduled"] * 100


def test_unfiled_counts_the_records_after_the_checkpoint_and_estimates_past_its_bound(
    sched: SimpleNamespace, tmp_path: Path
) -> None:
    with sched.folder(tmp_path) as (log, store):
        records = [sched.message(f"m{i:04d}", sched.EPOCH_MS + i) for i in range(100)]
        size = len(records[0])
        log.append(b"".join(records))
        log.flush()
        assert unfiled(log, store) == Unfiled(100 * size, 100, True)
        replay_step(log, store, max_bytes=30 * size)
        assert unfiled(log, store) == Unfiled(70 * size, 70, True)
        # A member far behind answers from the first bytes: the same-size records give the same count.
        assert unfiled(log, store, max_bytes=10 * size) == Unfiled(70 * size, 70, False)
        replay_step(log, store)
        assert unfiled(log, store) == Unfiled(0, 0, True)


async def test_counters_survive_a_stop_and_a_kill_so_is_filing_done_has_a_plain_answer(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        clock = cluster.clock
        now = clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler():
            await cluster.schedule_raw([sched.message(f"soon-{i}", now + 1_000 + i) for i in range(5)])
            await cluster.schedule_raw([sched.message(f"past-{i}", now - 60_000) for i in range(3)])  # rewritten
            await cluster.schedule_raw([sched.message(f"later-{i}", now + 2 * HOUR_MS + i) for i in range(4)])
            await receiver.wait_for(8)
            await clock.sleep_ms(2_000)  # saved a second at most after they moved
            before = await status(cluster, sched)
        expected = {"schedule_requests": 3, "scheduled": 12, "rewritten": 3, "filed": 12, "dispatched": 8}
        assert {name: counters(before)[name] for name in expected} == expected

        async with cluster.scheduler():  # stopped, started again: the same counters
            after_stop = await status(cluster, sched)
            assert counters(after_stop) == counters(before)
            assert after_stop["statistics"]["unfiled_bytes"] == 0  # filing is done...
            assert after_stop["statistics"]["scheduled"] == after_stop["statistics"]["filed"]  # ...of all 12
            shown = format_scheduler("scheduler-1", sched.SCHEDULER, after_stop)
            assert "filing done" in shown and "since created: 12 scheduled (3 due at once), 12 filed" in shown

        async with cluster.scheduler() as scheduler:  # the later four go out, then a kill
            await receiver.wait_for(12)
            await clock.sleep_ms(2_000)
            dispatched = scheduler.statistics()
            scheduler.crash()
            await trio.sleep_forever()  # cancelled by the crash, as the process would be
        assert dispatched.dispatched == 12
        async with cluster.scheduler():
            after_kill = counters(await status(cluster, sched))
        assert after_kill["dispatched"] == 12 and after_kill["scheduled"] == after_kill["filed"] == 12
        assert after_kill["dispatch_batches"] >= counters(before)["dispatch_batches"] + 1
