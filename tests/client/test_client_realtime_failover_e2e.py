"""A consumer and a producer across a real realtime failover, in-process under ``autojump_clock``.

The metaserver and two members of one realtime group (sync replication, one in-sync
slave required) are the real servers on a ``MemoryNetwork``; the clients' own
connections reach them through it too (``trio.open_tcp_stream`` is patched). The master
"dies" by ``crash()`` with every connection to it broken, as a SIGKILL would, and comes
back on its data folder, where it rejoins as the new master's slave.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client import ReceivedMessage, open_consumer, open_producer
from delaymq.clock import TrioClock
from delaymq.net.testing import MemoryNetwork
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.storage.threads import run_inline

from ..support.network import open_memory_metaserver
from ..support.polling import wait_until

META = "meta.test:20880"
A, B = "rt-a.test:20881", "rt-b.test:20881"
EPOCH_MS = 1_749_996_000_000
FAILOVER_AFTER_MS = 5_000
ACK_TIMEOUT_MS = 30_000


@dataclass
class Cluster:
    tmp: Path
    clock: TrioClock
    net: MemoryNetwork
    nursery: trio.Nursery
    members: dict[str, RealtimeServer] = field(default_factory=dict)
    _connections: dict[str, set[trio.CancelScope]] = field(default_factory=dict)
    _ended: dict[str, trio.Event] = field(default_factory=dict)

    async def start(self, address: str) -> RealtimeServer:
        """A member of group rt1 on its own data folder (again after a kill: a restart)."""
        if address in self._ended:
            await self._ended[address].wait()
        ended = self._ended[address] = trio.Event()

        async def run(*, task_status: Any) -> None:
            try:
                async with open_realtime_server(
                    data_dir=self.tmp / address, clock=self.clock, listen=None, advertise_address=address,
                    meta_address=META, group="rt1", run_blocking=run_inline, peers=self.net,
                    replication="sync", min_insync=1, ack_timeout_ms=ACK_TIMEOUT_MS, checkpoint_interval_ms=200,
                ) as server:  # fmt: skip
                    self.net.serve(address, partial(self._serve, address, server))
                    task_status.started(server)
                    await trio.sleep_forever()
            finally:
                ended.set()

        server: RealtimeServer = await self.nursery.start(run)
        self.members[address] = server
        return server

    async def _serve(self, address: str, server: RealtimeServer, stream: trio.abc.Stream) -> None:
        scopes = self._connections.setdefault(address, set())
        with trio.CancelScope() as scope:
            scopes.add(scope)
            try:
                await server.serve_stream(stream)
            finally:
                scopes.discard(scope)

    def kill(self, address: str) -> None:
        """As SIGKILL: the server stops where it is and every connection to it breaks."""
        self.members[address].crash()
        self.net.remove(address)
        for scope in self._connections.pop(address, set()):
            scope.cancel()


@asynccontextmanager
async def open_cluster(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    clock = TrioClock(EPOCH_MS)
    async with open_memory_metaserver(tmp, clock, META, failover_after_ms=FAILOVER_AFTER_MS) as (net, nursery):
        monkeypatch.setattr(trio, "open_tcp_stream", net.open_tcp_stream)
        yield Cluster(tmp, clock, net, nursery)


async def test_after_a_realtime_failover_acks_reach_the_new_master_and_only_unacked_hand_outs_come_back_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch) as cluster:
        master = await cluster.start(A)
        await wait_until(lambda: master.role == "master")
        slave = await cluster.start(B)
        await wait_until(lambda: slave.role == "slave" and master.replica_info().get("in_sync") == [B])
        names = [f"m{n}" for n in range(30)]
        async with open_producer(META, clock=cluster.clock) as producer:
            await producer.send_batch([producer.message("orders", name, id=name) for name in names])
        options: dict[str, Any] = {
            "group": "billing", "start": "earliest", "clock": cluster.clock, "poll_timeout": 1,
            "heartbeat_interval": 1, "pull_batch": 10, "max_messages_held": 20,
        }  # fmt: skip
        async with (
            open_consumer(META, "orders", **options) as consumer,
            open_producer(META, clock=cluster.clock) as producer,
        ):
            with trio.fail_after(60):
                first = [await consumer.receive() for _ in range(20)]  # held: pulls stop at 20
            assert [m.id for m in first] == names[:20]
            for message in first[:8]:
                await message.ack()
            assert await consumer.flush()  # m0..m7 acked on the old master
            cluster.kill(A)
            killed = trio.current_time()
            for message in first[8:12]:  # acked now: refused or unanswered until a master takes them
                await message.ack()
            assert not await consumer.flush()
            during: list[str] = []

            async def send_during_the_switch() -> None:
                during.append(await producer.send("orders", "during", id="during"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_during_the_switch)
                await wait_until(lambda: slave.role == "master")
                assert trio.current_time() - killed <= FAILOVER_AFTER_MS / 1000 + 2
                # The consumer follows the route to B, which has no slave in sync yet: refused, kept queued.
                await wait_until(lambda: consumer.core.links["rt1"].address == B)
                failures = consumer.statistics().settle_failures
                await wait_until(lambda: consumer.statistics().settle_failures > failures)
                back = await cluster.start(A)  # the deposed master, on its data folder: a slave now
                await wait_until(lambda: back.role == "slave" and slave.replica_info().get("in_sync") == [A])
            assert during == ["during"]
            # The hand-outs not acked (m12..m19) come back after the ack timeout, marked; then the rest.
            again: list[ReceivedMessage] = []
            with trio.fail_after(ACK_TIMEOUT_MS / 1000 + 60):
                while len(again) < 8 + 10 + 1:
                    message = await consumer.receive()
                    again.append(message)
                    await message.ack()
            # Nothing acked comes back, not even after another ack timeout.
            with trio.move_on_after(ACK_TIMEOUT_MS / 1000 + 10):
                extra = await consumer.receive()
                pytest.fail(f"{extra.id} (attempt {extra.attempts}) came back after it was acked")
            assert await consumer.flush()
        attempts = {m.id: m.attempts for m in again}
        assert Counter(m.id for m in again) == Counter(names[12:] + ["during"])  # each once
        assert {n: attempts[n] for n in names[12:20]} == dict.fromkeys(names[12:20], 1)
        assert {n: attempts[n] for n in names[20:] + ["during"]} == dict.fromkeys(names[20:] + ["during"], 0)
        stats = slave.statistics()
        # The new master took the acks of m8..m11 (handed out by the old one): only m12..m19 went back.
        assert (stats.role, stats.redeliveries, stats.messages_stored) == ("master", 8, 1)
        assert stats.epoch > 0
