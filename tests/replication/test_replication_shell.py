"""The replicated-server shell's parts without a server: the writer's settle events a role
change waits on, the replication statistics' wire map (both server kinds' layouts), and
what role a member reports for each session."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.protocol.routes import ServerKind
from delaymq.replication.epochs import EpochHistory
from delaymq.replication.roles import Handover, NotMaster, Role
from delaymq.replication.shell import InFlight, ReplicatedServer
from delaymq.replication.statistics import (
    CutCounts,
    MasterReplication,
    ReplicaProgress,
    ReplicationStatistics,
    SlaveReplication,
    TickLag,
)
from delaymq.storage.log import SegmentedLog
from delaymq.storage.threads import run_inline
from delaymq.storage.writer import open_log_writer


def record(i: int) -> bytes:
    return encode(RecordKind.OPAQUE, f"record-{i}".encode())


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_the_writer_wakes_who_waits_for_it_to_settle(tmp_path: Path, autojump_clock: Any, flush: Any) -> None:
    async def slow_disk(work: Callable[[], Any]) -> Any:
        await trio.sleep(0.01)
        return await run_inline(work)

    with SegmentedLog.open(tmp_path, segment_size=8192) as log:
        async with open_log_writer(log, flush=flush, run_blocking=slow_disk) as writer:
            await writer.wait_idle()  # nothing queued: at once
            await writer.wait_durable()
            settled: list[str] = []
            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(writer.append, record(i))
                await trio.sleep(0.001)
                assert writer.statistics().pending == 5  # queued, none written yet

                async def idle() -> None:
                    await writer.wait_idle()
                    settled.append("idle")
                    assert not writer.statistics().pending and log.end_offset > 0

                async def durable() -> None:
                    await writer.wait_durable()
                    settled.append("durable")
                    assert log.flushed_offset == log.end_offset > 0

                nursery.start_soon(idle)
                nursery.start_soon(durable)
            assert sorted(settled) == ["durable", "idle"]


async def test_in_flight_lets_a_drain_wait_for_the_requests_being_served(autojump_clock: Any) -> None:
    requests = InFlight()
    await requests.wait_idle()
    order: list[str] = []

    async def serve() -> None:
        with requests.serving():
            await trio.sleep(1)
            order.append("served")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        await trio.sleep(0.1)
        assert requests.count == 1
        await requests.wait_idle()
        order.append("drained")
    assert order == ["served", "drained"]


BASE = {"mode": "sync", "min_insync": 1, "durable_end": 900, "history": [(3, 0)]}
REPLICA = ReplicaProgress("b:1", acked=900, lag_bytes=0, lag_ms=0, in_sync=True, seconds_since_fetch=0.5)


def test_replication_statistics_keep_each_kinds_wire_map() -> None:
    master = ReplicationStatistics(
        **BASE, cut=CutCounts(records=1, bytes=10, messages=2), master=MasterReplication(900, (REPLICA,), True)
    )
    assert list(master.to_wire()) == [
        *BASE, "cut_records", "cut_messages", "cut_bytes", "high_watermark", "in_sync_recorded", "replicas", "accepting",
    ]  # fmt: skip
    assert master.to_wire()["replicas"] == [
        {"address": "b:1", "acked": 900, "lag_bytes": 0, "lag_ms": 0, "in_sync": True, "seconds_since_fetch": 0.5}
    ]
    realtime_slave = ReplicationStatistics(
        **BASE, cut=CutCounts(messages=0), slave=SlaveReplication(950, 50, 3, 1, applied_offset=800)
    )
    assert list(realtime_slave.to_wire()) == [
        *BASE, "cut_records", "cut_messages", "cut_bytes",
        "master_durable_end", "lag_bytes", "fetches", "fetch_failures", "applied_offset",
    ]  # fmt: skip
    scheduler_slave = ReplicationStatistics(
        **BASE, cut=CutCounts(), slave=SlaveReplication(950, 50, 3, 1, tick=TickLag(20, None, 4))
    )
    assert list(scheduler_slave.to_wire()) == [
        *BASE, "cut_records", "cut_bytes", "master_durable_end", "lag_bytes",
        "tick_age_ms", "tick_behind_ms", "held_dispatch_entries", "fetches", "fetch_failures",
    ]  # fmt: skip
    # Read in-process as the map it sends (the metrics and the cli read it so).
    assert dict(scheduler_slave) == scheduler_slave.to_wire()
    assert scheduler_slave.get("tick_behind_ms", 0) is None and "applied_offset" not in scheduler_slave
    assert msgpack.packb(dict(realtime_slave)) == msgpack.packb(realtime_slave.to_wire())
    assert CutCounts(1, 10, 2) + CutCounts(2, 5, 1) == CutCounts(3, 15, 3)
    assert CutCounts(1, 10) + CutCounts(2, 5) == CutCounts(3, 15)


@dataclass
class Member:
    group: str = "g"
    address: str = "a:1"
    clock: Any = None
    history: EpochHistory = field(default_factory=EpochHistory)
    peers: None = None
    registration: None = None
    mode: str = "sync"
    min_insync: int = 0
    writer: None = None


class Master:
    def __init__(self, epoch: int, *, accepting: bool) -> None:
        self.epoch, self.accepting, self.source = epoch, accepting, None
        self.handover = Handover(what="test", epoch=epoch, hand_over=self._hand_over, resume=lambda: None)

    async def _hand_over(self, target: str) -> None: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


class Slave:
    fetcher: Any = None

    def __init__(self, master: str, epoch: int) -> None:
        self.master_address, self.epoch = master, epoch

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


async def test_a_member_reports_master_only_while_it_takes_requests(tmp_path: Path) -> None:
    async def ended(session: object) -> None: ...

    with SegmentedLog.open(tmp_path) as log:
        shell = ReplicatedServer(
            Member(),
            kind=ServerKind.REALTIME,
            name="realtime server",
            log=log,
            master_type=Master,
            slave_type=Slave,
            make_master=lambda epoch: Master(epoch, accepting=False),
            make_slave=Slave,
            session_ended=ended,
        )
        assert (shell.role, shell.epoch) == (Role.WAITING, 0)
        starting = Master(4, accepting=False)
        shell.roles.session = starting
        assert (shell.role, shell.epoch) == ("waiting", 4)  # taking over, or handing over: not master yet
        with pytest.raises(NotMaster, match=r"SEND: realtime server a:1 of group g is not master now \(waiting"):
            shell.taking_requests("SEND")
        starting.accepting = True
        assert shell.role == "master" and shell.taking_requests("SEND") is starting
        assert shell.replica_info() == {"offset": 0, "epoch": 4, "mode": "sync"}  # standalone: no source
        shell.roles.session = Slave("m:1", 5)
        assert shell.role == "slave" and shell.epoch == 5
        with pytest.raises(NotMaster, match=r"is a slave \(its master is m:1\); ask the metaserver"):
            shell.taking_requests("PULL")
