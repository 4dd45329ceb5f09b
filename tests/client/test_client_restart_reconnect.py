"""Clients reach a restarted realtime server soon after it is back, however long it was away.

A metaserver and a realtime server run in-process on an in-memory network under
``autojump_clock``; the clients' own connections dial through it too, so the
transport's redial rules are the real ones. The realtime server is stopped (its
connections end, its address refuses new ones, as a killed process's) and started
again on the same data folder and address. A client's next try then comes at the
end of its own backoff, never more than that backoff's cap after the server is back:
no other wait is stacked on it (the transport's, before redialling an address whose
last connect failed, grew to seconds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client import open_consumer, open_producer
from delaymq.client.delivery import PULL_BACKOFF
from delaymq.client.routes import CALL_BACKOFF
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.testing import MemoryNetwork
from delaymq.realtime.server import open_realtime_server
from delaymq.storage.threads import run_inline

EPOCH = 1_767_225_600_000
META = "meta.test:20880"
REALTIME = "rt1.test:20881"
#: Outages (seconds), short and long; all shorter than the metaserver's eviction (30 s).
OUTAGES = (1.5, 6.0, 20.0)


@dataclass
class World:
    clock: TrioClock
    nursery: trio.Nursery
    network: MemoryNetwork
    tmp_path: Path
    stop: trio.Event

    async def start_realtime(self) -> None:
        self.stop = trio.Event()
        await self.nursery.start(self._serve_realtime, self.stop)

    def kill_realtime(self) -> None:
        self.stop.set()

    async def _serve_realtime(self, stop: trio.Event, *, task_status: trio.TaskStatus[None]) -> None:
        connections: set[trio.CancelScope] = set()

        async def serve_stream(stream: trio.abc.Stream) -> None:
            with trio.CancelScope() as connection:
                connections.add(connection)
                try:
                    await server.serve_stream(stream)
                finally:
                    connections.discard(connection)
                    await trio.aclose_forcefully(stream)  # the client reads the end of the stream

        async with open_realtime_server(
            data_dir=self.tmp_path / "rt1", clock=self.clock, listen=None, group="rt1", meta_address=META,
            advertise_address=REALTIME, run_blocking=run_inline,
        ) as server:  # fmt: skip
            self.network.serve(REALTIME, serve_stream)
            task_status.started()
            await stop.wait()
            self.network.take_down(REALTIME)
            for connection in list(connections):
                connection.cancel()


@asynccontextmanager
async def open_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    clock = TrioClock(EPOCH)
    async with trio.open_nursery() as nursery:
        network = MemoryNetwork(nursery)
        monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)  # every dial, the clients' too
        async with open_metaserver(
            listen=None, data_dir=tmp_path / "meta", clock=clock, run_blocking=run_inline
        ) as meta:
            network.serve(META, meta.serve_stream)
            world = World(clock, nursery, network, tmp_path, trio.Event())
            await world.start_realtime()
            yield world
            world.kill_realtime()
        nursery.cancel_scope.cancel()


async def test_a_restarted_group_is_pulled_again_within_the_pull_backoff_cap_however_long_it_was_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    waits: list[float] = []
    async with (
        open_world(tmp_path, monkeypatch) as world,
        open_producer(META, clock=world.clock, peers=world.network) as producer,  # no redial wait of its own
        open_consumer(META, "orders", group="g", start="earliest", clock=world.clock) as consumer,
    ):
        await producer.send("orders", b"before")
        with trio.fail_after(60):
            await (await consumer.receive()).ack()
        for outage in OUTAGES:
            world.kill_realtime()
            await trio.sleep(outage)  # down this long: the consumer's pulls fail and back off meanwhile
            await world.start_realtime()
            await producer.send("orders", f"after {outage} s".encode())  # stored: the group is back
            stored = trio.current_time()
            with trio.fail_after(60):
                message = await consumer.receive()
            waits.append(trio.current_time() - stored)
            await message.ack()
            assert message.body == f"after {outage} s".encode()
    assert all(wait <= PULL_BACKOFF.maximum_ms / 1000 for wait in waits), waits


async def test_a_send_waiting_for_a_restarted_group_goes_through_within_the_call_backoff_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    waits: list[float] = []
    async with open_world(tmp_path, monkeypatch) as world, open_producer(META, clock=world.clock) as producer:
        await producer.send("orders", b"before")
        for outage in OUTAGES:
            world.kill_realtime()
            sent = trio.Event()
            back = 0.0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send_then_set, producer, f"during a {outage} s outage", sent)  # retried meanwhile
                await trio.sleep(outage)  # down this long: the send backs off meanwhile
                assert not sent.is_set()
                await world.start_realtime()
                back = trio.current_time()
            waits.append(trio.current_time() - back)
    assert all(wait <= CALL_BACKOFF.maximum_ms / 1000 for wait in waits), waits


async def _send_then_set(producer: Any, body: str, sent: trio.Event) -> None:
    await producer.send("orders", body)
    sent.set()
