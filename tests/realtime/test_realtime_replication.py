"""Realtime replication in-process under ``autojump_clock``: a slave's copy of the message
log and of consumer progress, failover, the sync refusals, and a deposed master's cut.

Every server is the real one on a ``MemoryNetwork``; a master "dies" by ``crash()``
(nothing more written, as a SIGKILL) and is taken off the network.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.clock import TrioClock
from delaymq.metaserver.groups import DEFAULT_FAILOVER_AFTER_MS
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.fencing import Fence
from delaymq.protocol.records import decode_batch, encode_message
from delaymq.realtime.checkpoint import CONSUMERS_DB, SHARES_DB
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.storage.threads import run_inline

from ..support.network import Partition, open_memory_metaserver
from ..support.polling import wait_until

META = "meta.test:1"
A, B, C = "rt-a.test:1", "rt-b.test:1", "rt-c.test:1"
EPOCH_MS = 1_749_996_000_000
GROUP = "rt1"
CONSUMER = {"group": "g1", "consumer": "c1", "subject": "orders"}


@dataclass
class Cluster:
    tmp: Path
    clock: TrioClock
    net: MemoryNetwork
    nursery: trio.Nursery
    members: dict[str, RealtimeServer] = field(default_factory=dict)

    async def start(self, address: str, **options: Any) -> RealtimeServer:
        """A member of group rt1 in the cluster's nursery: its ``crash()`` ends only its own task."""

        async def run(*, task_status: Any) -> None:
            settings = {
                "data_dir": self.tmp / address,
                "clock": self.clock,
                "listen": None,
                "advertise_address": address,
                "meta_address": META,
                "group": GROUP,
                "run_blocking": run_inline,
                "peers": self.net,
                "checkpoint_interval_ms": 200,
                **options,
            }
            async with open_realtime_server(**settings) as server:
                self.net.serve(address, server.serve_stream)
                try:
                    task_status.started(server)
                    await trio.sleep_forever()
                finally:
                    self.net.remove(address)

        server: RealtimeServer = await self.nursery.start(run)
        self.members[address] = server
        return server

    def kill(self, address: str) -> None:
        self.members[address].crash()
        self.net.remove(address)

    async def pair(self, **options: Any) -> tuple[RealtimeServer, RealtimeServer]:
        """A (master) and B (its slave, in sync)."""
        master = await self.start(A, **options)
        await wait_until(lambda: master.role == "master")
        slave = await self.start(B, **options)
        await wait_until(lambda: slave.role == "slave" and master.replica_info().get("in_sync") == [B])
        return master, slave

    async def send(self, address: str, names: list[str], **metadata: Any) -> list[str]:
        body = b"".join(encode_message(name, "orders", body=name.encode(), created_at=EPOCH_MS) for name in names)
        frame = await self.net.call(address, Command.SEND, metadata, body)
        results: list[str] = frame.metadata["results"]
        return results

    async def pull(self, address: str, count: int) -> tuple[int, list[tuple[str, int]]]:
        """(pull start, [(id, attempts)]) of one PULL by consumer c1 of group g1."""
        frame = await self.net.call(
            address, Command.PULL, {**CONSUMER, "max": count, "timeout_ms": 1_000, "from": "earliest"}
        )
        messages = decode_batch(frame.body)
        return frame.metadata["pull_start"], [(m.id, m.attempts) for m in messages]

    async def ack(self, address: str, start: int, end: int) -> None:
        await self.net.call(address, Command.ACK, {**CONSUMER, "start": start, "end": end})


@asynccontextmanager
async def open_cluster(tmp: Path, *, failover_after_ms: int = 5_000) -> AsyncIterator[Cluster]:
    clock = TrioClock(EPOCH_MS)
    async with open_memory_metaserver(tmp, clock, META, failover_after_ms=failover_after_ms) as (net, nursery):
        yield Cluster(tmp, clock, net, nursery)


def log_bytes(server: RealtimeServer) -> bytes:
    message_log = server.member.storage.message_log
    data = bytearray()
    offset = message_log.start_offset
    while offset < message_log.end_offset:
        chunk, offset = message_log.read_raw(offset)
        data += chunk
    return bytes(data)


def committed(server: RealtimeServer, db: str) -> dict[bytes, bytes]:
    return dict(server.member.storage.store.items(db))


async def test_a_slave_holds_the_log_and_the_consumer_progress_of_its_master(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1)
        assert await cluster.send(A, [f"m{i}" for i in range(30)]) == ["stored"] * 30
        # Answered under sync replication: the slave held every byte before the answer.
        assert slave.member.storage.message_log.flushed_offset >= master.member.storage.message_log.flushed_offset
        start, got = await cluster.pull(A, 20)
        assert [name for name, _ in got] == [f"m{i}" for i in range(20)]
        await cluster.ack(A, start, start + 12)
        end = master.member.storage.message_log.end_offset
        await wait_until(lambda: slave.statistics().replication.get("applied_offset") == end)
        assert log_bytes(slave) == log_bytes(master)
        assert committed(slave, SHARES_DB) == committed(master, SHARES_DB) != {}
        assert committed(slave, CONSUMERS_DB) == committed(master, CONSUMERS_DB) != {}
        status = master.statistics()
        assert (status.role, slave.statistics().role) == ("master", "slave")
        assert [r["address"] for r in status.replication["replicas"]] == [B]
        assert status.replication["replicas"][0]["in_sync"]
        # A slave refuses what only a master takes, naming its master.
        with pytest.raises(PeerError) as refused:
            await cluster.send(B, ["x"])
        assert refused.value.code == "not_master"
        assert A in str(refused.value)


async def test_after_a_failover_nothing_acked_comes_back_and_the_rest_comes_back_marked(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1, ack_timeout_ms=10_000)
        third = await cluster.start(C, min_insync=1, ack_timeout_ms=10_000)  # a slave for the next master
        await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
        names = [f"m{i}" for i in range(40)]
        assert await cluster.send(A, names) == ["stored"] * 40
        start, got = await cluster.pull(A, 25)
        await cluster.ack(A, start, start + 10)  # m0..m9 acked; m10..m24 handed out, not acked
        cluster.kill(A)
        killed = cluster.clock.monotonic_ms()
        await wait_until(lambda: slave.role == "master")
        assert cluster.clock.monotonic_ms() - killed <= 5_000 + 2_000
        await wait_until(lambda: slave.replica_info().get("in_sync") == [C])  # sync: the new master's slave
        # A producer's retry of a batch the old master had stored (same ids) is stored once.
        assert await cluster.send(B, names[:5]) == ["duplicate"] * 5
        # Acks of the old master's hand-outs are taken by the new one (same pull log).
        await cluster.ack(B, start + 10, start + 12)  # m10, m11
        seen: list[tuple[str, int]] = []
        while len(seen) < 40 - 12:
            _start, got = await cluster.pull(B, 100)
            seen += got
            if got:
                await cluster.ack(B, _start, _start + len(got))
        ids = [name for name, _ in seen]
        assert sorted(ids) == sorted(names[12:])  # nothing acked is handed out again, nothing lost
        attempts = dict(seen)
        assert [n for n in names[12:25] if attempts[n] != 1] == []  # handed out before: marked
        assert [n for n in names[25:] if attempts[n] != 0] == []  # never handed out: first attempt


async def test_with_the_defaults_a_group_of_two_serves_through_either_members_death(
    tmp_path: Path, autojump_clock: Any
) -> None:
    """The commands' defaults (sync, min_insync 0, the metaserver's 1 s failover): SEND, PULL and
    ACK are served by the survivor of either death, within the replication timeout, never refused."""
    async with open_cluster(tmp_path, failover_after_ms=DEFAULT_FAILOVER_AFTER_MS) as cluster:
        master, slave = await cluster.pair()
        cluster.kill(B)
        asked = cluster.clock.monotonic_ms()
        assert await cluster.send(A, ["alone"]) == ["stored"]  # once B left the in-sync set
        start, got = await cluster.pull(A, 10)
        await cluster.ack(A, start, start + len(got))
        assert [name for name, _ in got] == ["alone"]
        assert cluster.clock.monotonic_ms() - asked < 5_000
        slave = await cluster.start(B)  # back on its folder: in sync again
        await wait_until(lambda: master.replica_info().get("in_sync") == [B])
        assert await cluster.send(A, ["m1", "m2"]) == ["stored"] * 2
        cluster.kill(A)
        killed = cluster.clock.monotonic_ms()
        await wait_until(lambda: slave.role == "master")
        assert cluster.clock.monotonic_ms() - killed <= 1_500
        assert await cluster.send(B, ["m3"]) == ["stored"]
        start, got = await cluster.pull(B, 10)
        assert [name for name, _ in got] == ["m1", "m2", "m3"]
        await cluster.ack(B, start, start + len(got))


async def test_sync_with_no_slave_in_sync_refuses_and_stores_nothing(tmp_path: Path, autojump_clock: Any) -> None:
    async with open_cluster(tmp_path) as cluster:
        master = await cluster.start(A, min_insync=1, replication_timeout_ms=2_000)
        await wait_until(lambda: master.role == "master")
        end = master.member.storage.message_log.end_offset
        with pytest.raises(PeerError) as refused:
            await cluster.send(A, ["lonely"])
        assert (refused.value.code, refused.value.field) == ("unavailable", "min_insync")
        assert master.member.storage.message_log.end_offset == end  # refused before anything was stored


async def test_the_fence_table_survives_a_failover(tmp_path: Path, autojump_clock: Any) -> None:
    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1)
        third = await cluster.start(C, min_insync=1)
        await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
        fence = Fence("scheduler-1", 7).as_metadata()
        assert await cluster.send(A, ["f1"], **fence) == ["stored"]
        cluster.kill(A)
        await wait_until(lambda: slave.role == "master" and slave.replica_info().get("in_sync") == [C])
        with pytest.raises(PeerError) as refused:
            await cluster.send(B, ["f2"], **Fence("scheduler-1", 6).as_metadata())
        assert refused.value.code == "fenced"
        assert await cluster.send(B, ["f3"], **fence) == ["stored"]


async def test_a_deposed_async_master_rejoins_as_a_slave_cutting_what_its_successor_never_had(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        partition = Partition(cluster.net)
        master = await cluster.start(A, replication="async")
        await wait_until(lambda: master.role == "master")
        slave = await cluster.start(B, replication="async", peers=partition)
        await wait_until(lambda: slave.role == "slave" and master.replica_info().get("in_sync") == [B])
        assert await cluster.send(A, ["shared"]) == ["stored"]
        await wait_until(
            lambda: slave.member.storage.message_log.flushed_offset == master.member.storage.message_log.flushed_offset
        )
        partition.cut.add(A)  # the slave stops fetching (still in sync for the master's lag window)
        assert await cluster.send(A, ["tail-1", "tail-2"]) == ["stored", "stored"]  # async: answered alone
        data_dir = tmp_path / A
        cluster.kill(A)
        await wait_until(lambda: slave.role == "master")
        assert await cluster.send(B, ["after"]) == ["stored"]
        # The deposed master comes back on its data folder: a slave now, its tail cut.
        back = await cluster.start(A, replication="async", data_dir=data_dir)
        await wait_until(lambda: back.role == "slave")
        await wait_until(lambda: log_bytes(back) == log_bytes(slave))
        replication = back.statistics().replication
        assert replication["cut_messages"] == 2
        assert replication["cut_bytes"] > 0


async def test_a_graceful_handover_keeps_every_ack_and_hands_nothing_out_twice(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1)
        third = await cluster.start(C, min_insync=1)
        await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
        names = [f"h{i}" for i in range(30)]
        assert await cluster.send(A, names) == ["stored"] * 30
        start, got = await cluster.pull(A, 10)
        await cluster.ack(A, start, start + 10)
        answer = await cluster.net.call(META, Command.HANDOVER, {"group": GROUP, "to": B})
        assert answer.metadata["to"] == B
        await wait_until(lambda: slave.role == "master" and master.role == "slave")
        await wait_until(lambda: slave.replica_info().get("in_sync") == [A, C])
        seen: list[tuple[str, int]] = []
        while len(seen) < 20:
            start, got = await cluster.pull(B, 100)
            seen += got
            if got:
                await cluster.ack(B, start, start + len(got))
        assert seen == [(name, 0) for name in names[10:]]  # in order, each once, none marked
