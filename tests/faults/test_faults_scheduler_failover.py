"""A replicated scheduler group of real processes: its master SIGKILLed, frozen, its metaserver restarted.

A metaserver, a realtime server, a scheduler master and its slave each run as a
``delaymq`` process (``delaymq.bench.failover.open_replicated_group``). A producer
schedules a few hundred messages a second due 1-20 s ahead, sending a failed batch
again with the same ids until the group takes it; a consumer acks everything. The
master is then SIGKILLed (or SIGSTOPped past ``--failover-after``) at a random moment.
Every acknowledged message must arrive, none before its ``deliver_at`` by the machine
clock, none twice; the slave must be master within ``--failover-after`` + 2 s; the old
master, started again on its data folder (or woken), must rejoin as a slave. A third
test restarts the metaserver between failovers: the group's epoch keeps going up.
A server that dies of an error (a traceback in its log) fails a test, whatever else
happened.
"""

from __future__ import annotations

import math
import random
import signal
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.bench.cluster import BODY
from delaymq.bench.failover import (
    GROUP,
    SUBJECT,
    ReplicatedGroup,
    ServerChild,
    Tally,
    consume,
    open_replicated_group,
    send_until_stored,
    wall_ms,
)
from delaymq.client import open_producer

pytestmark = pytest.mark.faults

#: The metaserver's default: a master's lease.
FAILOVER_AFTER_MS = 1_000
#: What the metaserver's detection and the slave's take-over may add to --failover-after.
TAKEOVER_SLACK_MS = 2_000
#: A busy master's stall (GC, a slow disk) that must cost no failover.
STALL_MS = 500
#: Batches of this many messages every 50 ms: a few hundred messages a second.
BATCH = 20


async def produce(meta: str, tally: Tally, stop: trio.Event, *, seed: int, delay: tuple[float, float]) -> None:
    """Batches of ``BATCH`` messages due ``delay`` s ahead every 50 ms until ``stop``; a batch the group
    did not take is sent again (same ids) until it does."""
    rng = random.Random(seed)
    async with open_producer(meta, timeout=2.0) as producer:
        while not stop.is_set():
            batch = [producer.message(SUBJECT, BODY, delay=rng.uniform(*delay)) for _ in range(BATCH)]
            await send_until_stored(producer, batch, tally)
            await trio.sleep(0.05)  # the producer's pace


async def wait_promoted(group: ReplicatedGroup, slave: ServerChild, *, since_ms: int) -> tuple[dict[str, Any], int]:
    """Poll the slave's STATUS until it says master; its STATUS and the ms since ``since_ms``."""
    timeout = (FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS) / 1000 + 10  # beyond the bound: measured, then asserted
    answer = await group.wait_status(slave.address, lambda a: a["role"] == "master", timeout=timeout, poll=0.02)
    return answer, wall_ms() - since_ms


def check_delivery(tally: Tally, fault_report: Any, **figures: Any) -> None:
    """Record the figures a user looks at, then assert: nothing lost, early or twice."""
    lateness = tally.lateness_ms()
    lost, early, duplicated = tally.missing(), tally.early(), tally.duplicated()
    fault_report.record(
        messages=len(tally.acked),
        lost=len(lost),
        early=len(early),
        duplicated=duplicated,
        max_lateness_ms=round(max(lateness, default=0)),
        send_errors=tally.send_errors,
        **figures,
    )
    assert len(tally.acked) > 1_000
    assert not lost, f"{len(lost)} acknowledged message(s) never arrived, e.g. {sorted(lost)[:5]}"
    assert not early, [(i, tally.received[i], tally.received_due[i]) for i in early[:5]]
    assert duplicated == 0


async def test_a_sigkilled_master_is_replaced_by_its_slave_and_rejoins_as_a_slave_with_nothing_lost_early_or_twice(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any, cut_in_log: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    tally, stop = Tally(), trio.Event()
    with servers_must_not_crash(tmp_path), trio.fail_after(90):
        async with open_replicated_group(tmp_path, failover_after_ms=FAILOVER_AFTER_MS) as group:
            master, slave = group.members
            async with trio.open_nursery() as nursery:
                await nursery.start(consume, group.meta.address, tally)
                nursery.start_soon(partial(produce, group.meta.address, tally, stop, seed=seed, delay=(1.0, 20.0)))
                await trio.sleep(rng.uniform(2.0, 6.0))  # a random moment under load: a schedule, not a wait
                epoch_before = (await group.status(master.address))["epoch"]
                killed = wall_ms()
                await master.kill()
                promoted, failover_ms = await wait_promoted(group, slave, since_ms=killed)
                assert promoted["epoch"] > epoch_before
                # The old master, started again on its data folder, rejoins as a slave of the new one.
                rejoined = await group.start_member(master, role="slave")
                assert rejoined["epoch"] == promoted["epoch"]
                in_step = await group.wait_status(
                    master.address,
                    lambda a: a["role"] == "slave" and a["statistics"]["replication"].get("lag_bytes") == 0,
                    timeout=20,
                )
                await trio.sleep(2)  # load on the new master: a schedule, not a wait
                stop.set()
                with trio.move_on_after(40):  # the last are due within 20 s; any missing then are reported lost
                    await tally.wait_all_in(timeout=math.inf)
                realtime = await group.status(group.realtime.address)
                nursery.cancel_scope.cancel()
    cut = in_step["statistics"]["replication"]["cut_records"]
    check_delivery(
        tally,
        fault_report,
        seed=seed,
        failover_ms=failover_ms,
        max_lateness_due_after_takeover_ms=round(max(tally.lateness_ms(due_from=killed + failover_ms), default=0)),
        resends_absorbed=realtime["statistics"]["duplicates"],
        cut_records=cut,
    )
    assert failover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
    assert cut == cut_in_log(master, 2)  # a cut tail is counted in STATUS as it is logged
    assert realtime["fences"][GROUP] == promoted["epoch"]


async def test_a_master_frozen_past_failover_after_delivers_nothing_when_it_wakes_and_rejoins_as_a_slave(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any, cut_in_log: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    tally, stop = Tally(), trio.Event()
    with servers_must_not_crash(tmp_path), trio.fail_after(90):
        async with open_replicated_group(tmp_path, failover_after_ms=FAILOVER_AFTER_MS) as group:
            master, slave = group.members
            async with trio.open_nursery() as nursery:
                await nursery.start(consume, group.meta.address, tally)
                nursery.start_soon(partial(produce, group.meta.address, tally, stop, seed=seed, delay=(1.0, 20.0)))
                await trio.sleep(rng.uniform(2.0, 6.0))  # a random moment under load: a schedule, not a wait
                epoch_before = (await group.status(master.address))["epoch"]
                frozen = wall_ms()
                master.send_signal(signal.SIGSTOP)
                promoted, failover_ms = await wait_promoted(group, slave, since_ms=frozen)
                assert promoted["epoch"] > epoch_before
                # Woken after it was replaced, with a wheel full of messages due while it slept:
                # it must send none of them, and follow the new master.
                before_wake = (await group.status(group.realtime.address))["statistics"]
                master.send_signal(signal.SIGCONT)
                woken = wall_ms()
                rejoined = await group.wait_status(
                    master.address,
                    lambda a: a["role"] == "slave" and a["epoch"] == promoted["epoch"],
                    timeout=20,
                )
                rejoin_ms = wall_ms() - woken
                await trio.sleep(2)  # load on the new master: a schedule, not a wait
                stop.set()
                with trio.move_on_after(40):  # the last are due within 20 s; any missing then are reported lost
                    await tally.wait_all_in(timeout=math.inf)
                in_step = await group.wait_status(
                    master.address, lambda a: a["statistics"]["replication"].get("lag_bytes") == 0, timeout=20
                )
                realtime = await group.status(group.realtime.address)
                nursery.cancel_scope.cancel()
    statistics = realtime["statistics"]
    old_log = master.log_text()
    cut = in_step["statistics"]["replication"]["cut_records"]
    check_delivery(
        tally,
        fault_report,
        seed=seed,
        failover_ms=failover_ms,
        rejoin_after_wake_ms=rejoin_ms,
        resends_absorbed=statistics["duplicates"],
        resends_absorbed_after_wake=statistics["duplicates"] - before_wake["duplicates"],
        fenced_sends=statistics["fenced"],
        mastership_checks=old_log.count("confirming mastership"),
        cut_records=cut,
    )
    assert rejoined["role"] == "slave"
    assert failover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
    assert cut == cut_in_log(master, 1)
    assert realtime["fences"][GROUP] == promoted["epoch"]


async def test_a_master_stalled_for_half_a_second_keeps_its_group(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any
) -> None:
    """A 500 ms stall of a master under load (SIGSTOP, then SIGCONT) is within its lease: no failover,
    nothing lost, early or twice."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    tally, stop = Tally(), trio.Event()
    with servers_must_not_crash(tmp_path), trio.fail_after(90):
        async with open_replicated_group(tmp_path, failover_after_ms=FAILOVER_AFTER_MS) as group:
            master, slave = group.members
            async with trio.open_nursery() as nursery:
                await nursery.start(consume, group.meta.address, tally)
                nursery.start_soon(partial(produce, group.meta.address, tally, stop, seed=seed, delay=(1.0, 5.0)))
                epochs = []
                for _ in range(3):
                    await trio.sleep(rng.uniform(1.0, 2.0))  # a random moment under load: a schedule, not a wait
                    epochs.append((await group.status(master.address))["epoch"])
                    master.send_signal(signal.SIGSTOP)
                    await trio.sleep(STALL_MS / 1000)  # the stall itself
                    master.send_signal(signal.SIGCONT)
                await trio.sleep(FAILOVER_AFTER_MS / 1000 + 1)  # a failover would have happened by now
                after = await group.status(master.address)
                slave_after = await group.status(slave.address)
                stop.set()
                with trio.move_on_after(20):  # the last are due within 5 s; any missing then are reported lost
                    await tally.wait_all_in(timeout=math.inf)
                nursery.cancel_scope.cancel()
    check_delivery(tally, fault_report, seed=seed, stalls=len(epochs), stall_ms=STALL_MS)
    assert (after["role"], after["epoch"]) == ("master", epochs[0]) and set(epochs) == {epochs[0]}
    assert slave_after["role"] == "slave"


async def test_epochs_keep_going_up_across_metaserver_restarts_and_failovers(
    tmp_path: Path, fault_report: Any, servers_must_not_crash: Any
) -> None:
    tally, stop = Tally(), trio.Event()
    epochs: list[int] = []
    with servers_must_not_crash(tmp_path), trio.fail_after(90):
        async with open_replicated_group(tmp_path, failover_after_ms=FAILOVER_AFTER_MS) as group:
            first, second = group.members
            meta = group.meta.address
            async with trio.open_nursery() as nursery:
                await nursery.start(consume, meta, tally)
                nursery.start_soon(partial(produce, meta, tally, stop, seed=1, delay=(1.0, 8.0)))

                async def serving() -> None:
                    """Until the producer got ten more batches in: the group takes SCHEDULE again."""
                    await tally.wait_acked(len(tally.acked) + 10 * BATCH, timeout=15)

                async def restart_metaserver(master: ServerChild, slave: ServerChild) -> None:
                    await group.meta.kill()
                    await serving()  # a metaserver outage stops failover, not service
                    assert await group.meta.start(listen=meta) == meta  # same data folder, same address
                    await group.wait_in_sync(master, slave)
                    # The restarted metaserver restored the group: the same master in the same epoch.
                    rows = (await group.status(meta))["rows"]
                    assert {row["epoch"] for row in rows if row["group"] == GROUP} == {epochs[-1]}
                    assert (await group.status(master.address))["epoch"] == epochs[-1]
                    await serving()

                async def fail_over(master: ServerChild, slave: ServerChild) -> None:
                    killed = wall_ms()
                    await master.kill()
                    promoted, failover_ms = await wait_promoted(group, slave, since_ms=killed)
                    assert failover_ms <= FAILOVER_AFTER_MS + TAKEOVER_SLACK_MS
                    epochs.append(promoted["epoch"])
                    # With --min-insync 1 the new master takes SCHEDULE once a slave is in sync again.
                    await group.start_member(master, role="slave")
                    await group.wait_in_sync(slave, master)
                    await serving()

                epochs.append((await group.status(first.address))["epoch"])
                await serving()
                await restart_metaserver(first, second)
                await fail_over(first, second)  # second is master
                await restart_metaserver(second, first)
                await fail_over(second, first)  # first is master again
                # The realtime server holds (durably) the newest epoch: the one the master sends.
                await group.wait_status(
                    group.realtime.address, lambda a: a["fences"].get(GROUP) == epochs[-1], timeout=10
                )
                stop.set()
                with trio.move_on_after(30):  # the last are due within 8 s; any missing then are reported lost
                    await tally.wait_all_in(timeout=math.inf)
                nursery.cancel_scope.cancel()
    check_delivery(tally, fault_report, epochs=" < ".join(map(str, epochs)))
    assert epochs == sorted(set(epochs)), epochs  # strictly increasing
