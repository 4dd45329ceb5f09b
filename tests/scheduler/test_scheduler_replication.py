"""Scheduler replication in-process under ``autojump_clock``: byte identity, the tick
stream, promotion, fencing, graceful handover and clock skew (docs/replication.md).

Every server is the real one on a ``MemoryNetwork``; a master "dies" by ``crash()``
(nothing more written, as a SIGKILL) and is taken off the network.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.cli.status_command import format_scheduler
from delaymq.clock import TrioClock
from delaymq.net.connection import TransportError
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import encode_message
from delaymq.scheduler.server import Scheduler

from ..support.network import Partition
from ..support.polling import wait_until

A, B, C = "sched-a.test:1", "sched-b.test:1", "sched-c.test:1"
SECOND = 1_000


def log_bytes(scheduler: Scheduler) -> bytes:
    log = scheduler.member.log
    data = bytearray()
    offset = log.start_offset
    while offset < log.end_offset:
        chunk, offset = log.read_raw(offset)
        data += chunk
    return bytes(data)


def hour_files(scheduler: Scheduler) -> dict[str, bytes]:
    folder = scheduler.store.directory
    return {
        name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith((".log", ".idx"))
    }


async def schedule(cluster: Any, sched: Any, names: list[str], at: int, address: str) -> None:
    frame = await cluster.net.call(address, Command.SCHEDULE, {}, b"".join(sched.message(n, at) for n in names))
    assert frame.metadata["results"] == ["scheduled"] * len(names)


META_OPTIONS = {"failover_after_ms": 5_000}


async def start_pair(
    cluster: Any, *, master: dict[str, Any] | None = None, slave: dict[str, Any] | None = None, **both: Any
) -> tuple[Scheduler, Scheduler]:
    """Members A (first: master) and B (its slave), once A reports B in sync."""
    first = await cluster.start_member(A, **both, **(master or {}))
    second = await cluster.start_member(B, **both, **(slave or {}))
    await wait_until(lambda: first.role == "master" and second.role == "slave")
    await wait_until(lambda: first.replica_info().get("in_sync") == [B])
    return first, second


async def test_a_slave_holds_the_masters_log_and_hour_files_byte_for_byte(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        master, slave = await start_pair(cluster, min_insync=1)
        await wait_until(lambda: master.role == "master" and slave.role == "slave")
        await wait_until(
            lambda: A in master.replica_info().get("in_sync", []) or B in master.replica_info().get("in_sync", [])
        )
        start = cluster.clock.now_ms()
        for batch in range(20):
            names = [f"m{batch}-{i}" for i in range(50)]
            await schedule(cluster, sched, names, start + 3 * 3_600_000 + batch * 7_919, A)
        # Answered under sync replication: the slave held every byte before each answer.
        assert slave.member.log.flushed_offset >= master.member.log.flushed_offset
        await wait_until(lambda: slave.store.checkpoint == master.store.checkpoint == master.member.log.end_offset)
        assert log_bytes(slave) == log_bytes(master)
        assert hour_files(slave) == hour_files(master) != {}
        status = master.statistics().replication
        assert [r["address"] for r in status["replicas"]] == [B]
        assert status["replicas"][0]["lag_bytes"] == 0
        # What `delaymq status` prints of each member.
        shown = {
            address: format_scheduler(
                "scheduler-1", address, (await cluster.net.call(address, Command.STATUS, {})).metadata
            )
            for address in (A, B)
        }
        assert f"{A}: master (epoch {master.epoch})" in shown[A]
        assert f"slave {B}: in sync, lag 0 bytes / 0 ms" in shown[A]
        assert f"{B}: slave (epoch {master.epoch})" in shown[B]
        assert "behind the master by 0 bytes; tick held" in shown[B]
        # The replication map of STATUS: its keys in the order the scheduler has always sent them.
        common = ["mode", "min_insync", "durable_end", "history", "cut_records", "cut_bytes"]
        for address, own in (
            (A, ["high_watermark", "in_sync_recorded", "replicas", "accepting"]),
            (B, ["master_durable_end", "lag_bytes", "tick_age_ms", "tick_behind_ms", "held_dispatch_entries",
                 "fetches", "fetch_failures"]),
        ):  # fmt: skip
            answer = (await cluster.net.call(address, Command.STATUS, {})).metadata
            assert list(answer["statistics"]["replication"]) == common + own


async def test_the_tick_and_dispatch_records_reach_the_slave(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        master, slave = await start_pair(cluster, min_insync=1)
        await wait_until(lambda: master.role == "master" and slave.role == "slave")
        await wait_until(lambda: master.replica_info().get("in_sync") == [B])
        now = cluster.clock.now_ms()
        names = [f"t{i}" for i in range(200)]
        for i, name in enumerate(names):
            await schedule(cluster, sched, [name], now + 2 * SECOND + i * 37, A)
        await receiver.wait_for(len(names))
        hour = (now + 2 * SECOND) // 3_600_000
        await wait_until(lambda: slave.store.delivered(hour) == master.store.delivered(hour))
        assert len(slave.store.delivered(hour)) == len(names)
        held = slave.statistics().tick
        assert held == master.statistics().tick
        # The tick keeps coming about every 50 ms while nothing happens.
        before = slave.session.master_tick.received_ms  # type: ignore[union-attr]
        await trio.sleep(1)
        assert slave.session.master_tick.received_ms > before  # type: ignore[union-attr]
        assert slave.statistics().replication["tick_age_ms"] <= 100


async def test_a_killed_master_is_replaced_by_its_slave_and_nothing_is_lost_early_or_twice(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        now = cluster.clock.now_ms()
        names = [f"k{i}" for i in range(600)]
        due = {name: now + 1_000 + i * 33 for i, name in enumerate(names)}  # due over 20 s
        master, slave = await start_pair(cluster, min_insync=1)
        for name in names:
            await schedule(cluster, sched, [name], due[name], A)
        await trio.sleep(6)  # let a part go out through the first master
        master.crash()
        cluster.net.remove(A)
        killed_at = cluster.clock.now_ms()
        await wait_until(lambda: slave.role == "master")
        promoted_ms = cluster.clock.now_ms() - killed_at
        assert promoted_ms <= 5_000 + 2_000
        assert slave.epoch > 0
        await receiver.wait_for(len(names))
        await trio.sleep(2)
        got = Counter(receiver.ids())
        assert set(got) == set(names)
        assert [n for n, c in got.items() if c > 1] == []
        assert [r.id for r in receiver.got if r.received_at < r.deliver_at] == []
        assert max(r.received_at - r.deliver_at for r in receiver.got) <= 5_000 + 2_000 + 500


async def test_with_the_defaults_a_group_of_two_keeps_serving_through_either_members_death(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    """The commands' defaults (sync, min_insync 0, the metaserver's 1 s failover): the survivor
    of either death takes SCHEDULEs, and a master's death costs about a second of lateness."""
    async with sched.open_cluster(tmp_path) as cluster:
        receiver = cluster.receiver()
        master, slave = await start_pair(cluster)
        slave.crash()
        cluster.net.remove(B)
        asked = cluster.clock.now_ms()
        await schedule(cluster, sched, ["alone"], asked + SECOND, A)  # waits for B to leave the set, then answered
        assert cluster.clock.now_ms() - asked < 5 * SECOND  # within the replication timeout: never refused
        await receiver.wait_for(1)
        slave = await cluster.start_member(B)  # back on its folder: in sync again
        await wait_until(lambda: master.replica_info().get("in_sync") == [B])
        now = cluster.clock.now_ms()
        names = [f"d{i}" for i in range(100)]
        for i, name in enumerate(names):
            await schedule(cluster, sched, [name], now + SECOND + i * 30, A)  # due over 3 s
        await trio.sleep(1.5)
        master.crash()
        cluster.net.remove(A)
        killed = cluster.clock.now_ms()
        await wait_until(lambda: slave.role == "master")
        assert cluster.clock.now_ms() - killed <= 1_500
        await schedule(cluster, sched, ["survivor"], cluster.clock.now_ms(), B)
        await receiver.wait_for(len(names) + 2)
        got = Counter(receiver.ids())
        assert set(got) == {"alone", "survivor", *names} and max(got.values()) == 1
        assert [r.id for r in receiver.got if r.received_at < r.deliver_at] == []
        assert max(r.received_at - r.deliver_at for r in receiver.got) <= 1_500


async def test_a_replaced_master_is_fenced_by_the_realtime_server_and_rejoins_as_a_slave(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        partition = Partition(cluster.net)
        now = cluster.clock.now_ms()
        names = [f"f{i}" for i in range(300)]
        old, new = await start_pair(cluster, min_insync=1, master={"peers": partition})
        await wait_until(lambda: old.role == "master" and new.role == "slave")
        await wait_until(lambda: old.replica_info().get("in_sync") == [B])
        await schedule(cluster, sched, ["warm-up"], now, A)  # the old master learns the route
        await receiver.wait_for(1)
        for i, name in enumerate(names):
            await schedule(cluster, sched, [name], now + 8 * SECOND + i * 40, A)
        first_epoch = old.epoch
        partition.cut.add("meta.test:1")  # the old master no longer hears the metaserver
        await wait_until(lambda: new.role == "master")
        assert new.epoch > first_epoch
        # Both dispatch what falls due; the realtime server refuses the old epoch.
        await wait_until(lambda: cluster.realtime["rt1"].statistics().fenced > 0)
        assert old.role != "master"
        partition.cut.clear()
        await wait_until(lambda: old.role == "slave")
        await receiver.wait_for(len(names) + 1)
        await trio.sleep(2)
        got = Counter(receiver.ids())
        assert set(got) == {*names, "warm-up"} and max(got.values()) == 1
        assert [r.id for r in receiver.got if r.received_at < r.deliver_at] == []


async def test_a_graceful_handover_sends_nothing_twice(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        now = cluster.clock.now_ms()
        names = [f"h{i}" for i in range(400)]
        first, second = await start_pair(cluster, min_insync=1)
        await wait_until(lambda: first.role == "master" and second.role == "slave")
        await wait_until(lambda: first.replica_info().get("in_sync") == [B])
        for i, name in enumerate(names):
            await schedule(cluster, sched, [name], now + SECOND + i * 25, A)
        await trio.sleep(4)  # in the middle of the run
        answer = await cluster.net.call("meta.test:1", Command.HANDOVER, {"group": "scheduler-1", "to": B})
        assert answer.metadata["to"] == B
        await wait_until(lambda: second.role == "master" and first.role == "slave")
        await receiver.wait_for(len(names))
        await trio.sleep(2)
        rt = cluster.realtime["rt1"].statistics()
        got = Counter(receiver.ids())
        assert set(got) == set(names) and max(got.values()) == 1
        assert rt.duplicates == 0  # not one re-send reached the realtime server's dedup


@pytest.mark.parametrize("skew_ms", [300, -300])
async def test_a_new_master_with_a_skewed_clock_delivers_nothing_early_by_its_own_clock(
    sched: Any, tmp_path: Path, autojump_clock: Any, skew_ms: int
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        skewed = TrioClock(cluster.clock.now_ms() + skew_ms)
        now = cluster.clock.now_ms()
        names = [f"s{i}" for i in range(300)]
        master, slave = await start_pair(cluster, min_insync=1, slave={"clock": skewed})
        for i, name in enumerate(names):
            await schedule(cluster, sched, [name], now + SECOND + i * 30, A)
        await trio.sleep(3)
        master.crash()
        cluster.net.remove(A)
        await wait_until(lambda: slave.role == "master")
        await receiver.wait_for(len(names))
        got = Counter(receiver.ids())
        assert set(got) == set(names) and max(got.values()) == 1
        # Received times are the cluster's clock; the new master's reads skew_ms more.
        early = [r.id for r in receiver.got if r.received_at + max(skew_ms, 0) < r.deliver_at]
        assert early == []


async def test_a_deposed_master_rejoins_as_a_slave_cutting_the_tail_its_successor_never_had(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        partition = Partition(cluster.net)
        now = cluster.clock.now_ms()
        old, new = await start_pair(cluster, min_insync=1, slave={"peers": partition})
        await schedule(cluster, sched, ["kept"], now + 20 * SECOND, A)
        partition.cut.add(A)  # the slave stops hearing its master
        await wait_until(lambda: new.statistics().replication["fetch_failures"] > 0)
        end = old.member.log.end_offset

        async def unanswered() -> None:
            with pytest.raises((TransportError, PeerError)):  # the master dies before any slave holds it
                await schedule(cluster, sched, ["never-acknowledged"], now + 20 * SECOND, A)

        cluster.nursery.start_soon(unanswered)
        await wait_until(lambda: old.member.log.end_offset > end)
        assert old.store.checkpoint <= end  # under sync, nothing past what a slave holds is filed
        old.crash()
        cluster.net.remove(A)
        partition.cut.clear()
        await wait_until(lambda: new.role == "master")
        rejoined = await cluster.start_member(A, min_insync=1)
        await wait_until(
            lambda: rejoined.role == "slave" and rejoined.member.log.end_offset == new.member.log.end_offset
        )
        replication = rejoined.statistics().replication
        assert replication["cut_records"] == 1
        assert log_bytes(rejoined) == log_bytes(new)
        await receiver.wait_for(1)
        await trio.sleep(25)
        assert receiver.ids() == ["kept"]


async def test_a_handover_the_metaserver_drops_leaves_the_master_serving(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        master, target = await start_pair(cluster)
        await cluster.net.call("meta.test:1", Command.HANDOVER, {"group": "scheduler-1", "to": B})
        target.crash()  # the target dies right as the handover is asked
        cluster.net.remove(B)
        async with trio.open_nursery() as nursery:
            # Taken before the master hears of the handover: B never gets it, so it can never hold everything.
            nursery.start_soon(schedule, cluster, sched, ["before"], cluster.clock.now_ms() + 30 * SECOND, A)
            await wait_until(lambda: not master.session.accepting)  # type: ignore[union-attr]
            # Handing over, the master session takes no requests: the member reports ``waiting``.
            assert master.role == "waiting" and master.statistics().role == "waiting"
            await wait_until(lambda: master.session.accepting, timeout=60)  # type: ignore[union-attr]
        assert master.role == "master" and master.replica_info().get("handed_over") is None
        now = cluster.clock.now_ms()
        await schedule(cluster, sched, ["after"], now + SECOND, A)
        await receiver.wait_for(2)
        assert receiver.ids() == ["after", "before"]


async def test_sync_with_no_slave_in_sync_refuses_retryably_and_stores_nothing(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        master = await cluster.start_member(A, min_insync=1)
        await wait_until(lambda: master.role == "master")
        end = master.member.log.end_offset
        with pytest.raises(PeerError) as refused:
            await schedule(cluster, sched, ["lonely"], cluster.clock.now_ms() + SECOND, A)
        assert (refused.value.code, refused.value.field, refused.value.limit) == ("unavailable", "min_insync", 1)
        assert "0 slave(s) are in sync" in str(refused.value) and "nothing was stored" in str(refused.value)
        assert master.member.log.end_offset == end
        slave = await cluster.start_member(B, min_insync=1)
        await wait_until(lambda: master.replica_info().get("in_sync") == [B])
        await schedule(cluster, sched, ["lonely"], cluster.clock.now_ms() + SECOND, A)  # the retry is stored
        await wait_until(lambda: slave.member.log.end_offset == master.member.log.end_offset > end)
        with pytest.raises(PeerError) as at_slave:
            await schedule(cluster, sched, ["wrong-door"], cluster.clock.now_ms() + SECOND, B)
        assert at_slave.value.code == "not_master"  # retryable: producers ask the metaserver again


async def test_async_replication_answers_at_once_and_the_slave_follows(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        master = await cluster.start_member(A, replication="async", min_insync=1)
        await wait_until(lambda: master.role == "master")
        await schedule(cluster, sched, ["alone"], cluster.clock.now_ms() + 60 * SECOND, A)  # no slave: answered
        slave = await cluster.start_member(B, replication="async", min_insync=1)
        await wait_until(lambda: slave.role == "slave")
        await wait_until(lambda: log_bytes(slave) == log_bytes(master) != b"")
        assert hour_files(slave) == hour_files(master)


async def test_a_slave_far_behind_catches_up_over_many_fetches(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        master = await cluster.start_member(A, min_insync=0)
        await wait_until(lambda: master.role == "master")
        start = cluster.clock.now_ms()
        body = b"x" * 2_000
        for batch in range(30):  # about 6 MB over several hours
            records = [
                encode_message(
                    f"b{batch}-{i}", "orders", body=body, deliver_at=start + 3_600_000 + (batch * 100 + i) * 1_000
                )
                for i in range(100)
            ]
            frame = await cluster.net.call(A, Command.SCHEDULE, {}, b"".join(records))
            assert len(frame.metadata["results"]) == 100
        slave = await cluster.start_member(B, min_insync=0)
        await wait_until(lambda: slave.store.checkpoint == master.member.log.end_offset)
        assert slave.statistics().replication["fetches"] >= 2  # 4 MiB at most per answer
        assert log_bytes(slave) == log_bytes(master)
        assert hour_files(slave) == hour_files(master)


@pytest.mark.parametrize("lost", ["schedule", "cancel"])
async def test_under_async_a_deposed_master_cuts_even_what_it_had_filed_and_counts_it(
    sched: Any, tmp_path: Path, autojump_clock: Any, lost: str
) -> None:
    """What the deposed master filed alone is a SCHEDULE, or a CANCEL (which files no entry)."""
    async with sched.open_cluster(tmp_path, meta=META_OPTIONS) as cluster:
        receiver = cluster.receiver()
        partition = Partition(cluster.net)
        now = cluster.clock.now_ms()
        due = now + 30 * SECOND
        old, new = await start_pair(cluster, replication="async", min_insync=1, slave={"peers": partition})
        await schedule(cluster, sched, ["kept"], due, A)
        await wait_until(lambda: new.store.checkpoint == old.member.log.end_offset)
        partition.cut.add(A)
        await wait_until(lambda: new.statistics().replication["fetch_failures"] > 0)
        if lost == "schedule":
            await schedule(cluster, sched, ["lost-with-the-old-master"], due, A)  # answered: async
        else:  # answered at once too; the new master never hears of it, so "kept" is delivered
            await cluster.net.call(A, Command.CANCEL, {"ids": ["kept"]})
        await wait_until(lambda: old.store.checkpoint == old.member.log.end_offset)  # and filed at once
        old.crash()
        cluster.net.remove(A)
        partition.cut.clear()
        await wait_until(lambda: new.role == "master")
        await schedule(cluster, sched, ["after-the-failover"], due, B)  # takes the lost one's entry number
        rejoined = await cluster.start_member(A, replication="async", min_insync=1)
        await wait_until(lambda: rejoined.role == "slave" and rejoined.store.checkpoint == new.member.log.end_offset)
        assert rejoined.statistics().replication["cut_records"] == 1
        assert log_bytes(rejoined) == log_bytes(new)
        assert hour_files(rejoined) == hour_files(new)
        await receiver.wait_for(2)
        await trio.sleep(5)
        assert sorted(receiver.ids()) == ["after-the-failover", "kept"]
        hour = due // 3_600_000
        await wait_until(lambda: rejoined.store.delivered(hour) == new.store.delivered(hour) == {0, 1})
