"""A SCHEDULE that comes after its moment (a retry across a restart): delivered at once, with
the ``deliver_at`` its producer asked for, and counted as late as it is.

Real servers on an in-memory network under ``autojump_clock`` (see conftest.py).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import trio

from delaymq.protocol.commands import Command

from ..support.polling import wait_until
from .conftest import QUIET

SECOND = 1_000


def hour_files(scheduler: Any) -> dict[str, bytes]:
    folder = scheduler.store.directory
    return {
        name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith((".log", ".index"))
    }


async def ask(cluster: Any, address: str, command: Command, ids: list[str]) -> dict[str, str]:
    frame = await cluster.net.call(address, command, {"ids": ids})
    return {r["id"]: r["state"] for r in frame.metadata["results"]}


async def test_a_late_schedule_is_delivered_at_once_with_its_deliver_at_and_counted_late(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        receiver = cluster.receiver()
        t0 = clock.now_ms() + 250
        await cluster.schedule_raw([sched.message("first", t0 + 500)])
        await receiver.wait_for(1)  # the wheel is past t0 + 500, in the second of t0 + 600
        await clock.sleep_until_ms(t0 + 600)
        now = clock.now_ms()
        asked = {
            "a-second-late": now - 1_071,
            "behind-the-wheel": now - 50,  # in the second the wheel is in, before its cursor
            "an-hour-late": now - 3_600_000,
            "this-second": now + 100,  # in the second the wheel has loaded
            "on-time": now + 5_000,
        }
        answer = await cluster.schedule_raw([sched.message(name, at) for name, at in asked.items()])
        assert answer.metadata["results"] == ["scheduled"] * 5
        got = {r.id: r for r in await receiver.wait_for(6)}
        for name, at in asked.items():
            assert got[name].deliver_at == at  # what the producer asked for, late or not
            assert got[name].received_at - max(at, now) <= 2, got[name]  # at once, or at its moment
        assert [r.id for r in receiver.got[1:4]] == ["a-second-late", "behind-the-wheel", "an-hour-late"]
        stats = scheduler.statistics()
        assert stats.rewritten == 3  # due at once
        assert stats.lateness_max_ms >= 3_600_000  # measured against the deliver_at asked for
        assert stats.lateness_fired["max"] >= 3_600_000
        assert stats.lateness_mean_ms >= 3_600_000 / 6
        assert cluster.realtime["rt1"].statistics().duplicates == 0


async def test_a_late_message_is_a_duplicate_until_delivered_and_cancels_go_by_where_it_is(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        receiver = cluster.receiver()
        cluster.stop_realtime("rt1")  # what fires waits in its lane
        now = clock.now_ms()
        asked = {"late-a": now - 2 * SECOND, "later-b": now + 3_600_000, "late-c": now - 1}
        batch = [sched.message(name, at) for name, at in asked.items()]
        assert (await cluster.schedule_raw(batch)).metadata["results"] == ["scheduled"] * 3
        assert (await cluster.schedule_raw(batch)).metadata["results"] == ["duplicate"] * 3
        await clock.sleep_until_ms(now + SECOND)
        assert await ask(cluster, sched.SCHEDULER, Command.QUERY, list(asked)) == {
            "late-a": "delivered",  # fired: on its way to realtime
            "later-b": "scheduled",
            "late-c": "delivered",
        }
        assert await ask(cluster, sched.SCHEDULER, Command.CANCEL, ["late-a", "later-b"]) == {
            "late-a": "delivered",
            "later-b": "cancelled",
        }
        await cluster.start_realtime("rt1")
        got = await receiver.wait_for(2)
        await clock.sleep_until_ms(now + 2 * 3_600_000)
        assert {(r.id, r.deliver_at) for r in got} == {("late-a", asked["late-a"]), ("late-c", asked["late-c"])}
        assert scheduler.statistics().pending == 0


async def test_late_messages_accepted_before_a_kill_are_delivered_after_it_with_their_deliver_at(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        clock = cluster.clock
        receiver = cluster.receiver()
        cluster.stop_realtime("rt1")
        now = clock.now_ms()
        asked = {f"late-{i}": now - 61 - i * 100 for i in range(10)}
        # flush="async": answered once written, filed once fsynced (every 20 ms); killed before that,
        # the records are only in the message log, and the restart files them.
        async with cluster.scheduler(flush="async") as scheduler:
            answer = await cluster.schedule_raw([sched.message(name, at) for name, at in asked.items()])
            assert answer.metadata["results"] == ["scheduled"] * 10
            unfiled = scheduler.statistics().unfiled_bytes
            scheduler.crash()
            await trio.sleep_forever()
        assert unfiled > 0
        await clock.sleep_until_ms(now + 60 * SECOND)
        await cluster.start_realtime("rt1")
        async with cluster.scheduler() as restarted:
            got = await receiver.wait_for(10)
            stats = restarted.statistics()
        assert {r.id: r.deliver_at for r in got} == asked
        assert max(Counter(r.id for r in got).values()) == 1
        assert all(r.received_at - (now + 60 * SECOND) <= 2 * SECOND for r in got)  # at once after the restart
        assert stats.lateness_max_ms >= 60 * SECOND + 61 + 900
        assert stats.rewritten == 10 and stats.filed == 10


async def test_a_slave_files_late_messages_where_its_master_did_and_delivers_them_after_a_failover(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    a, b = "sched-a.test:1", "sched-b.test:1"
    async with sched.open_cluster(tmp_path, meta={"failover_after_ms": 5_000}) as cluster:
        master = await cluster.start_member(a, min_insync=1)
        slave = await cluster.start_member(b, min_insync=1)
        await wait_until(lambda: master.replica_info().get("in_sync") == [b] and slave.role == "slave")
        cluster.stop_realtime("rt1")  # nothing is delivered before the failover
        now = cluster.clock.now_ms()
        asked = {"late-1": now - 3 * SECOND, "on-time": now + 10 * SECOND, "late-2": now - 1}
        frame = await cluster.net.call(a, Command.SCHEDULE, {}, b"".join(sched.message(n, t) for n, t in asked.items()))
        assert frame.metadata["results"] == ["scheduled"] * 3
        await wait_until(lambda: slave.store.checkpoint == master.member.log.end_offset)
        assert hour_files(slave) == hour_files(master) != {}  # the same entries, at the same moments
        master.crash()
        cluster.net.remove(a)
        await wait_until(lambda: slave.role == "master", timeout=60)
        receiver = cluster.receiver()
        await cluster.start_realtime("rt1")
        got = await receiver.wait_for(3)
        assert {r.id: r.deliver_at for r in got} == asked
