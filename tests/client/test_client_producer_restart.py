"""The producer rides out a restart of the only server group.

A metaserver, a realtime server and a scheduler run in-process on an in-memory
network under ``autojump_clock``: a server is restarted for real (its block
ends, its data folder is opened again by a new server at the same address), a
lost answer is a connection that drops after the server stored the batch, and a
30 s ``send_timeout`` costs milliseconds. The blocking producer's test runs on
loopback with the real clock and a real server stopped and started again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client import BlockingProducer, CallFailed, PeerError, open_consumer, open_producer
from delaymq.client.routes import CALL_BACKOFF, CallTimedOut
from delaymq.clock import SystemClock, TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable
from delaymq.net.limits import Limits
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.frames import Frame
from delaymq.protocol.records import decode_batch
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.scheduler.server import open_scheduler
from delaymq.storage.threads import run_inline

EPOCH = 1_767_225_600_000
META = "meta.test:20880"
REALTIME = "rt1.test:20881"
SCHEDULER = "sched1.test:20890"
OUTAGE = 0.8  # seconds the only group is away


class Slot:
    """One server at a fixed address that can be stopped and started again on the same data folder."""

    def __init__(
        self, nursery: trio.Nursery, network: MemoryNetwork, address: str,
        opener: Callable[[], AbstractAsyncContextManager[Any]],
    ) -> None:  # fmt: skip
        self._nursery = nursery
        self._network = network
        self.address = address
        self._opener = opener
        self.server: Any = None
        self._stop = trio.Event()
        self._stopped = trio.Event()

    async def start(self) -> Any:
        self._stop, self._stopped = trio.Event(), trio.Event()
        self.server = await self._nursery.start(self._run)
        return self.server

    async def _run(self, task_status: trio.TaskStatus[Any]) -> None:
        try:
            async with self._opener() as server:
                self._network.serve(self.address, server.serve_stream)
                task_status.started(server)
                await self._stop.wait()
                self._network.take_down(self.address)  # its connections break, as a process's do
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        self._stop.set()
        await self._stopped.wait()

    async def start_after(self, down_for: float) -> None:
        await trio.sleep(down_for)
        await self.start()


@dataclass
class Cluster:
    clock: TrioClock
    network: MemoryNetwork
    realtime: Slot
    scheduler: Slot


@asynccontextmanager
async def open_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, limits: Limits | None = None
) -> AsyncIterator[Cluster]:
    clock = TrioClock(EPOCH)
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # after the servers below have closed
        network = MemoryNetwork(nursery)
        monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)  # the servers' own connections
        meta = await stack.enter_async_context(
            open_metaserver(listen=None, data_dir=tmp_path / "meta", clock=clock, run_blocking=run_inline)
        )
        network.serve(META, meta.serve_stream)
        servers = await stack.enter_async_context(trio.open_nursery())
        stack.push_async_callback(_stop_all, servers)
        realtime = Slot(servers, network, REALTIME, lambda: open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=META, advertise_address=REALTIME,
            limits=limits or Limits(), run_blocking=run_inline,
        ))  # fmt: skip
        scheduler = Slot(servers, network, SCHEDULER, lambda: open_scheduler(
            data_dir=tmp_path / "sched1", clock=clock, group="sched1", listen=None, meta_address=META,
            advertise_address=SCHEDULER, run_blocking=run_inline,
        ))  # fmt: skip
        await realtime.start()
        await scheduler.start()
        yield Cluster(clock, network, realtime, scheduler)
        await realtime.stop()
        await scheduler.stop()


async def _stop_all(nursery: trio.Nursery) -> None:
    nursery.cancel_scope.cancel()


async def consumed(cluster: Cluster, subject: str, count: int) -> list[str]:
    """The ids a new consumer group gets of ``subject``, from the earliest: ``count``, then nothing for 60 s."""
    ids: list[str] = []
    async with open_consumer(META, subject, group="check", start="earliest", clock=cluster.clock) as consumer:
        with trio.fail_after(600):
            while len(ids) < count:
                message = await consumer.receive()
                ids.append(message.id)
                await message.ack()
        with trio.move_on_after(60):
            extra = await consumer.receive()
            ids.append(extra.id)
    return ids


class Recording:
    """The in-memory network, keeping the body of every request of ``command`` (answered or not)."""

    def __init__(self, network: MemoryNetwork, command: Command) -> None:
        self.network = network
        self.command = command
        self.bodies: list[bytes] = []

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        if command == self.command:
            self.bodies.append(body)
        return await self.network.call(address, command, metadata, body, timeout=timeout)


class LosingAnswers:
    """The in-memory network, but the answer to the first ``lose`` requests of ``command`` is lost.

    The server handles the request (and stores the batch); then the connection
    drops before the answer arrives, as when a server or a link fails at that moment.
    """

    def __init__(self, network: MemoryNetwork, command: Command, lose: int = 1) -> None:
        self.network = network
        self.command = command
        self.lose = lose

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        frame = await self.network.call(address, command, metadata, body, timeout=timeout)
        if command == self.command and self.lose:
            self.lose -= 1
            raise PeerUnavailable(f"connection to {address} lost: reset by peer", address=address)
        return frame


# ------------------------------------------------------------------- restarts


@pytest.mark.parametrize("delayed", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("batch", [False, True], ids=["send", "send_batch"])
async def test_a_restart_of_the_only_group_is_invisible_to_the_producer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock,
    delayed: bool, batch: bool,
) -> None:  # fmt: skip
    async with open_cluster(tmp_path, monkeypatch) as cluster:
        slot = cluster.scheduler if delayed else cluster.realtime
        delay = 5 if delayed else None
        network = Recording(cluster.network, Command.SCHEDULE if delayed else Command.SEND)
        async with open_producer(META, clock=cluster.clock, peers=network) as producer:
            before = await producer.send("orders", b"before", delay=delay)  # the route is known, the link up
            await slot.stop()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(slot.start_after, OUTAGE)
                started = cluster.clock.now_ms()
                if batch:
                    ids = await producer.send_batch(
                        [producer.message("orders", f"during {n}", delay=delay) for n in range(3)]
                    )
                else:
                    ids = [await producer.send("orders", b"during", delay=delay)]
                took = cluster.clock.now_ms() - started
            stats = producer.statistics()
        assert took >= OUTAGE * 1000  # it waited for the group to come back rather than fail
        assert stats.routes.unanswered >= 2 and stats.routes.refused == 0  # and retried, with backoff
        retried = network.bodies[1:]
        assert len(retried) == stats.routes.unanswered + 1 and len(set(retried)) == 1  # the same records each time
        assert [m.id for m in decode_batch(retried[0])] == ids
        assert stats.messages == 1 + len(ids) and stats.duplicates == 0
        assert sorted(await consumed(cluster, "orders", 1 + len(ids))) == sorted([before, *ids])  # each once


@pytest.mark.parametrize("delayed", [False, True], ids=["immediate", "delayed"])
async def test_a_retry_of_a_stored_batch_whose_answer_was_lost_is_success(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock, delayed: bool
) -> None:
    async with open_cluster(tmp_path, monkeypatch) as cluster:
        command = Command.SCHEDULE if delayed else Command.SEND
        delay = 5 if delayed else None
        network = LosingAnswers(cluster.network, command)
        async with open_producer(META, clock=cluster.clock, peers=network) as producer:
            first = [producer.message("orders", f"m{n}", delay=delay) for n in range(2)]
            assert await producer.send_batch(first) == [m.id for m in first]  # stored, answer lost, retried
            assert network.lose == 0
            third = producer.message("orders", "m2", delay=delay)
            assert await producer.send_batch([*first, third]) == [m.id for m in [*first, third]]  # partly held
            stats = producer.statistics()
        assert stats.routes.unanswered == 1 and stats.routes.retries == 1
        if not delayed:  # the realtime server says which records it held already
            assert (stats.messages, stats.duplicates) == (5, 4)
        # The scheduler keeps a retried batch again; the realtime server drops the copies it delivers.
        assert sorted(await consumed(cluster, "orders", 3)) == sorted(m.id for m in [*first, third])


async def test_after_send_timeout_the_error_says_what_was_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch) as cluster:
        async with open_producer(META, clock=cluster.clock, peers=cluster.network) as producer:
            await producer.send("orders", b"before")
            await cluster.realtime.stop()  # and it does not come back
            with pytest.raises(CallTimedOut, match=r"gave up after (1\.\d|2\.0) s \(send_timeout is 2 s\)"):
                async with open_producer(META, clock=cluster.clock, peers=cluster.network, send_timeout=2) as short:
                    await short.send("orders", b"lost too")
            started = cluster.clock.now_ms()
            with pytest.raises(CallFailed) as failed:
                await producer.send("orders", b"lost")
            took = cluster.clock.now_ms() - started
        error = failed.value
        assert isinstance(error, CallTimedOut)
        assert 29_000 <= took <= 30_000  # the default send_timeout, on the producer's clock
        at_most = 30_000 / (CALL_BACKOFF.maximum_ms / 2)  # every wait at least half the cap
        assert at_most / 3 <= len(error.attempts) <= at_most  # backed off: not thousands of tries, not three
        message = str(error)
        assert message.startswith(f"SEND on route 'immediate-producer' gave up after {took / 1000:.1f} s "
                                  f"(send_timeout is 30 s): {len(error.attempts)} failed attempts in ")  # fmt: skip
        tries = [attempt for attempt in error.attempts if attempt.group == "rt1"]
        assert f"group rt1 at {REALTIME}: {len(tries)} attempts, last error: cannot connect" in message
        # 30 s without a heartbeat: the metaserver dropped the group, and the producer waited for it anyway.
        assert "route lookup: " in message and "last error: no realtime group in RW" in message


async def test_a_refusal_of_the_request_itself_fails_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        open_cluster(tmp_path, monkeypatch, limits=Limits(max_body=10)) as cluster,
        open_producer(META, clock=cluster.clock, peers=cluster.network) as producer,
    ):
        started = cluster.clock.now_ms()
        with pytest.raises(PeerError) as refused:
            await producer.send("orders", b"more than ten bytes")  # the producer allows it, the server not
        assert (refused.value.code, refused.value.field) == ("limit", "body")
        assert cluster.clock.now_ms() == started
        assert producer.statistics().routes.retries == 0


async def test_the_blocking_producer_rides_out_a_real_server_restart(tmp_path: Path) -> None:
    """Real sockets, threads and clock: the server's listener closes and opens again on the same port."""
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta, trio.open_nursery() as nursery:
        assert meta.address is not None
        stop, stopped = trio.Event(), trio.Event()

        async def run_realtime(listen: str, *, task_status: trio.TaskStatus[RealtimeServer]) -> None:
            async with open_realtime_server(
                data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, listen=listen,
                flush="async",
            ) as server:  # fmt: skip
                task_status.started(server)
                await stop.wait()
            stopped.set()

        first = await nursery.start(run_realtime, "127.0.0.1:0")
        producer = BlockingProducer(meta.address, send_timeout=20)
        try:
            assert await trio.to_thread.run_sync(producer.send, "orders", b"before")
            stop.set()
            await stopped.wait()  # the port is closed: connections are refused
            stop, stopped = trio.Event(), trio.Event()
            result: list[str] = []

            async def send_during() -> None:
                result.append(await trio.to_thread.run_sync(producer.send, "orders", b"during"))

            with trio.fail_after(20):
                async with trio.open_nursery() as sending:
                    sending.start_soon(send_during)
                    while producer.statistics().routes.unanswered < 1:  # it has met the stopped server
                        await trio.sleep(0.01)
                    await trio.sleep(OUTAGE)  # and the outage goes on a while
                    again = await nursery.start(run_realtime, first.address)
            stats = producer.statistics()
        finally:
            producer.close()
        assert len(result) == 1 and stats.messages == 2
        assert stats.routes.unanswered >= 1  # it did fail while the server was away, and retried
        assert (again.statistics().messages_stored, again.statistics().duplicates) == (1, 0)  # stored once
        stop.set()
        nursery.cancel_scope.cancel()
