"""Producers and consumers end to end: a metaserver and realtime servers in-process on loopback.

Real sockets, so the real clock (no autojump); every wait is bounded by
``fail_after`` and ends on an observable condition, not on a sleep.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.client import (
    BlockingConsumer,
    BlockingProducer,
    ConsumerFailed,
    NoRouteError,
    PeerError,
    ReceivedMessage,
    open_consumer,
    open_producer,
)
from delaymq.client.registration import run_registration
from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.peers import open_peers
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.records import tag_bit
from delaymq.realtime.server import RealtimeServer, open_realtime_server

WAIT = 20.0  # seconds any one test may wait for messages


@dataclass
class Cluster:
    meta: str
    servers: dict[str, RealtimeServer]
    refused_sends: list[int] = field(default_factory=list)

    def delivered(self) -> int:
        return sum(server.statistics().messages_delivered for server in self.servers.values())

    def redelivered(self) -> int:
        return sum(server.statistics().redeliveries for server in self.servers.values())


async def _refusing_group(nursery: trio.Nursery, cluster: Cluster, name: str) -> None:
    """A realtime group that refuses every SEND as read-only and has nothing to hand out."""

    async def send(request: Request) -> None:
        cluster.refused_sends.append(len(request.body))
        raise RemoteProtocolError("group is read-only", code="read_only")

    async def pull(request: Request) -> tuple[dict[str, Any], bytes]:
        await trio.sleep(request.metadata.get("timeout_ms", 0) / 1000)
        return {"pull_start": 0, "count": 0, "acked": 0}, b""

    async def heartbeat(request: Request) -> dict[str, Any]:
        return {}

    server = FrameServer({Command.SEND: send, Command.PULL: pull, Command.CONSUMER_HEARTBEAT: heartbeat})
    address = await nursery.start(server.serve, "127.0.0.1", 0)
    info = {"group": name, "kind": "realtime", "role": "master", "address": address, "version": "test"}
    peers = await nursery.start(_peers_forever)
    await nursery.start(partial(run_registration, peers, meta_address=cluster.meta, info=info, clock=SystemClock()))


async def _peers_forever(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    async with open_peers() as peers:
        task_status.started(peers)
        await trio.sleep_forever()


@asynccontextmanager
async def open_cluster(
    tmp_path: Path, groups: tuple[str, ...] = ("rt1", "rt2"), *, refusing: str | None = None
) -> AsyncIterator[Cluster]:
    clock = SystemClock()
    async with AsyncExitStack() as stack:
        meta = await stack.enter_async_context(open_metaserver(data_dir=tmp_path / "meta", clock=clock))
        cluster = Cluster(meta.address, {})
        for name in groups:
            cluster.servers[name] = await stack.enter_async_context(
                open_realtime_server(
                    data_dir=tmp_path / name, clock=clock, group=name, meta_address=meta.address, flush="async"
                )
            )
        nursery = await stack.enter_async_context(trio.open_nursery())
        if refusing is not None:
            await _refusing_group(nursery, cluster, refusing)
        try:
            yield cluster
        finally:
            nursery.cancel_scope.cancel()


async def collect(
    consumer: Any, into: list[ReceivedMessage], done: trio.Event, expected: int, *, ack: bool = True
) -> None:
    async for message in consumer:
        into.append(message)
        if ack:
            await message.ack()
        if len(into) >= expected:
            done.set()


async def test_consumers_of_one_group_receive_every_message_once(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:
        received: list[ReceivedMessage] = []
        done = trio.Event()
        sent: list[str] = []
        with trio.fail_after(WAIT):
            async with AsyncExitStack() as stack:
                consumers = [
                    await stack.enter_async_context(
                        open_consumer(cluster.meta, "orders", group="billing", start="earliest", poll_timeout=1)
                    )
                    for _ in range(3)
                ]
                async with trio.open_nursery() as nursery:
                    for consumer in consumers:
                        nursery.start_soon(collect, consumer, received, done, 120)

                    async def produce(tag: str) -> None:
                        async with open_producer(cluster.meta) as producer:
                            for n in range(20):
                                sent.append(await producer.send("orders", f"{tag}-{n}"))
                            batch = [producer.message("orders", f"{tag}-batch-{n}") for n in range(40)]
                            sent.extend(await producer.send_batch(batch))

                    async with trio.open_nursery() as producers:
                        producers.start_soon(produce, "p1")
                        producers.start_soon(produce, "p2")
                    await done.wait()
                    nursery.cancel_scope.cancel()
        ids = Counter(message.id for message in received)
        assert sorted(ids) == sorted(sent) and len(sent) == 120
        assert max(ids.values()) == 1
        assert cluster.delivered() == 120  # no message was handed out twice
        assert cluster.redelivered() == 0
        assert {message.server_group for message in received} == {"rt1", "rt2"}  # both groups were used


async def test_two_groups_each_get_everything_and_broadcast_consumers_too(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:
        names = ("audit", "billing", "bcast-1", "bcast-2")
        received: dict[str, list[ReceivedMessage]] = {name: [] for name in names}
        events = {name: trio.Event() for name in names}
        with trio.fail_after(WAIT):
            async with AsyncExitStack() as stack:
                consumers = {
                    "audit": open_consumer(cluster.meta, "orders", group="audit", start="earliest"),
                    "billing": open_consumer(cluster.meta, "orders", group="billing", start="earliest"),
                    "bcast-1": open_consumer(cluster.meta, "orders", group="screens", broadcast=True, start="earliest"),
                    "bcast-2": open_consumer(cluster.meta, "orders", group="screens", broadcast=True, start="earliest"),
                }
                opened = {name: await stack.enter_async_context(manager) for name, manager in consumers.items()}
                async with trio.open_nursery() as nursery:
                    for name, consumer in opened.items():
                        nursery.start_soon(collect, consumer, received[name], events[name], 30)
                    async with open_producer(cluster.meta) as producer:
                        sent = await producer.send_batch([producer.message("orders", f"m{n}") for n in range(30)])
                    for event in events.values():
                        await event.wait()
                    nursery.cancel_scope.cancel()
        for name in names:
            assert sorted(m.id for m in received[name]) == sorted(sent), name


def colliding_tags() -> tuple[str, str]:
    seen: dict[int, str] = {}
    for n in itertools.count():
        tag = f"kind{n}"
        if tag_bit(tag) in seen:
            return seen[tag_bit(tag)], tag
        seen[tag_bit(tag)] = tag
    raise AssertionError("unreachable")


async def test_tag_filter_is_exact_even_when_the_server_mask_collides(tmp_path: Path) -> None:
    wanted, collider = colliding_tags()
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            # Colliders first: once the last wanted one arrives, every collider was pulled too.
            await producer.send_batch([producer.message("orders", f"c{n}", tags=[collider]) for n in range(5)])
            await producer.send_batch([producer.message("orders", f"u{n}") for n in range(5)])
            wanted_ids = await producer.send_batch(
                [producer.message("orders", f"w{n}", tags=[wanted, "x"]) for n in range(5)]
            )
        received: list[ReceivedMessage] = []
        done = trio.Event()
        with trio.fail_after(WAIT):
            async with open_consumer(cluster.meta, "orders", group="g", tags=[wanted], start="earliest") as consumer:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect, consumer, received, done, 5)
                    await done.wait()
                    nursery.cancel_scope.cancel()
                stats = consumer.statistics()
        assert [m.id for m in received] == wanted_ids
        assert stats.filtered == 5  # the colliders passed the server's mask; the client dropped them
        assert cluster.delivered() == 10  # untagged messages never left the server
        assert cluster.redelivered() == 0  # the dropped ones were acked, not left to time out


async def test_a_batch_refused_by_one_group_goes_to_another_without_duplicates(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",), refusing="rt0-readonly") as cluster:
        received: list[ReceivedMessage] = []
        done = trio.Event()
        with trio.fail_after(WAIT):
            async with open_consumer(cluster.meta, "orders", group="g", start="earliest", poll_timeout=1) as consumer:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect, consumer, received, done, 100)
                    async with open_producer(cluster.meta) as producer:
                        sent: list[str] = []
                        for batch in range(10):
                            sent += await producer.send_batch(
                                [producer.message("orders", f"b{batch}-{n}") for n in range(10)]
                            )
                        stats = producer.statistics()
                    await done.wait()
                    nursery.cancel_scope.cancel()
        assert cluster.refused_sends  # the read-only group was tried...
        assert stats.routes.refused >= 1
        assert stats.messages == 100 and stats.duplicates == 0
        assert sorted(m.id for m in received) == sorted(sent)  # ...and nothing was lost or doubled
        assert cluster.delivered() == 100


async def test_handler_errors_nack_and_the_message_comes_back(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            message_id = await producer.send("orders", b"flaky")
        attempts: list[int] = []
        with trio.fail_after(WAIT):
            async with open_consumer(cluster.meta, "orders", group="g", start="earliest") as consumer:

                async def handler(message: ReceivedMessage) -> None:
                    attempts.append(message.attempts)
                    if len(attempts) == 1:
                        raise ValueError("first try fails")
                    consumer.stop()  # run() returns once this message is handled

                await consumer.run(handler)
                stats = consumer.statistics()
        assert attempts == [0, 1]
        assert (stats.nacked, stats.acked, stats.held_messages) == (1, 1, 0)
        assert message_id


async def test_pulls_stop_at_the_held_cap(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            await producer.send_batch([producer.message("orders", b"x" * 10) for _ in range(12)])
        with trio.fail_after(WAIT):
            async with open_consumer(
                cluster.meta, "orders", group="g", start="earliest", max_messages_held=4, pull_batch=10
            ) as consumer:
                held = [await consumer.receive() for _ in range(4)]
                # The server handed out exactly the room the consumer had.
                assert cluster.delivered() == 4
                assert consumer.statistics().held_messages == 4
                for message in held:
                    await message.ack()
                rest = []
                for _ in range(8):
                    rest.append(await consumer.receive())
                    assert consumer.statistics().held_messages <= 4
                    await consumer.ack(rest[-1])
                assert await consumer.flush()
        assert len({m.id for m in held + rest}) == 12


async def test_delayed_messages_need_a_scheduler_route(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            with pytest.raises(NoRouteError, match="scheduler"):
                await producer.send("orders", b"later", delay=60)


async def test_blocking_twins_send_and_consume(tmp_path: Path) -> None:
    async with open_cluster(tmp_path) as cluster:

        def produce() -> list[str]:
            with BlockingProducer(cluster.meta) as producer:
                ids = [producer.send("orders", f"single {n}", tags=["t"]) for n in range(5)]
                ids += producer.send_batch([producer.message("orders", f"batch {n}") for n in range(15)])
                return ids

        def consume(count: int) -> list[ReceivedMessage]:
            got: list[ReceivedMessage] = []
            with BlockingConsumer(cluster.meta, "orders", group="g", start="earliest", poll_timeout=0.5) as consumer:
                for message in consumer.messages(timeout=WAIT):
                    got.append(message)
                    if len(got) % 2:
                        consumer.ack(message)
                    else:
                        message.ack()
                    if len(got) == count:
                        break
                assert consumer.flush()
                assert consumer.statistics().acked == count
            return got

        with trio.fail_after(WAIT * 2):
            sent = await trio.to_thread.run_sync(produce)
            got = await trio.to_thread.run_sync(consume, 20)
        assert sorted(m.id for m in got) == sorted(sent)
        assert cluster.redelivered() == 0
        assert {m.body for m in got if m.tags == ("t",)} == {f"single {n}".encode() for n in range(5)}


async def test_a_blocking_consumer_gives_back_what_it_received_and_never_handed_out(tmp_path: Path) -> None:
    """Closed after one message of a batch of 20: the other 19 reach the next consumer as they
    were (``attempts`` 0), well within ``WAIT``, a third of the servers' 60 s ack timeout."""
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        names = [f"m{n:02}" for n in range(20)]
        async with open_producer(cluster.meta) as producer:
            await producer.send_batch([producer.message("orders", name, id=name) for name in names])
        options: dict[str, Any] = {"group": "g", "start": "earliest", "pull_batch": 20, "poll_timeout": 0.5}

        def first() -> tuple[str, int]:
            with BlockingConsumer(cluster.meta, "orders", **options) as consumer:
                message = consumer.receive(timeout=WAIT)
                assert message is not None
                consumer.ack(message)
            return message.id, consumer.statistics().released

        def second() -> list[ReceivedMessage]:
            with BlockingConsumer(cluster.meta, "orders", **options) as consumer:
                got = list(itertools.islice(consumer.messages(timeout=WAIT), 19))
                for message in got:
                    consumer.ack(message)
            return got

        with trio.fail_after(WAIT):
            handled, released = await trio.to_thread.run_sync(first)
            rest = await trio.to_thread.run_sync(second)
        assert handled == "m00" and released == 19
        assert [m.id for m in rest] == names[1:] and {m.attempts for m in rest} == {0}
        assert cluster.redelivered() == 0 and cluster.delivered() == 20 + 19


async def test_acks_are_sent_when_the_consumer_is_closed_by_cancellation(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            await producer.send_batch([producer.message("orders", f"m{n}") for n in range(3)])
        server = cluster.servers["rt1"]
        with trio.fail_after(WAIT):
            with trio.CancelScope() as outer:
                async with open_consumer(cluster.meta, "orders", group="g", start="earliest") as consumer:
                    held = [await consumer.receive() for _ in range(3)]
                    outer.cancel()  # from here on the consumer's own tasks are cancelled
                    with trio.CancelScope(shield=True):
                        for message in held:
                            await message.ack()
                    assert server.statistics().acks == 0
        stats = server.statistics()
        assert stats.acks >= 1  # sent while closing, over fresh connections
        assert stats.redeliveries == 0
        assert consumer.statistics().acked == 3


async def test_a_group_that_joins_the_route_is_pulled_from(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        received: list[ReceivedMessage] = []
        done = trio.Event()
        with trio.fail_after(WAIT):
            async with open_consumer(
                cluster.meta, "orders", group="g", start="earliest", route_refresh=0.1, poll_timeout=1
            ) as consumer:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(collect, consumer, received, done, 10)
                    async with open_realtime_server(
                        data_dir=tmp_path / "rt2", clock=SystemClock(), group="rt2", meta_address=cluster.meta
                    ):
                        async with open_producer(cluster.meta) as producer:
                            sent = [await producer.send("orders", f"m{n}") for n in range(10)]
                        await done.wait()
                    nursery.cancel_scope.cancel()
        assert sorted(m.id for m in received) == sorted(sent)
        assert {m.server_group for m in received} == {"rt1", "rt2"}


async def test_a_refused_pull_ends_the_iteration_with_consumer_failed(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            await producer.send("orders", b"x")
        with trio.fail_after(WAIT):
            async with open_consumer(cluster.meta, "orders", group="g", consumer_id="c1", start="earliest") as consumer:
                await (await consumer.receive()).ack()
            # The same consumer id, now as a broadcast consumer: the server refuses it for good.
            async with open_consumer(cluster.meta, "orders", group="g", consumer_id="c1", broadcast=True) as consumer:
                with pytest.raises(ConsumerFailed, match="broadcast") as caught:
                    async for _ in consumer:
                        pass
        assert isinstance(caught.value.__cause__, PeerError)
        assert caught.value.__cause__.field == "broadcast"

        def blocking() -> None:
            with BlockingConsumer(cluster.meta, "orders", group="g", consumer_id="c1", broadcast=True) as consumer:
                with pytest.raises(ConsumerFailed, match="broadcast"):
                    consumer.receive(timeout=WAIT)

        await trio.to_thread.run_sync(blocking)


async def test_receive_batch_takes_what_has_arrived(tmp_path: Path) -> None:
    async with open_cluster(tmp_path, ("rt1",)) as cluster:
        async with open_producer(cluster.meta) as producer:
            sent = await producer.send_batch([producer.message("orders", f"m{n}") for n in range(7)])
        got: list[ReceivedMessage] = []
        with trio.fail_after(WAIT):
            async with open_consumer(cluster.meta, "orders", group="g", start="earliest") as consumer:
                first = await consumer.receive()  # the rest of its pull waits in the consumer
                got.append(first)
                with pytest.raises(ValueError, match="max_messages is 0"):
                    await consumer.receive_batch(max_messages=0)
                while len(got) < 7:
                    batch = await consumer.receive_batch(max_messages=4)
                    assert 1 <= len(batch) <= 4
                    got += batch
                for message in got:
                    await message.ack()
        assert [m.id for m in got] == sent  # one group: in order
