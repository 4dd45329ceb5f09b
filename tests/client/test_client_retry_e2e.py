"""Consumers end to end (retries, messages fetched ahead): metaserver, realtime and scheduler in-process.

The trio-client tests run under ``autojump_clock`` with a ``TrioClock``, so
retry delays take milliseconds. Every connection there is an in-memory stream
(``trio.open_tcp_stream`` is routed to the servers' ``serve_stream``) and
blocking calls run inline: with real sockets or worker threads the mock clock
could jump while bytes or an fsync are still on their way. The blocking
consumer's test runs on loopback with the real clock (delay 0 retries only).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client import BlockingConsumer, BlockingProducer, ReceivedMessage, open_consumer, open_producer
from delaymq.clock import SystemClock, TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.testing import MemoryNetwork
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.scheduler.server import Scheduler, open_scheduler
from delaymq.storage.threads import run_inline

EPOCH = 1_767_225_600_000
META = "meta.test:20880"
SCHEDULER = "scheduler.test:20890"
SECOND = 1000
WAIT = 20.0  # seconds the real-clock test may wait for a message


@dataclass
class Cluster:
    clock: TrioClock
    realtime: RealtimeServer
    scheduler: Scheduler | None


@asynccontextmanager
async def open_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, scheduler: bool, **scheduler_options: Any
) -> AsyncIterator[Cluster]:
    clock = TrioClock(EPOCH)
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        # Runs once the servers above it are closed (a cancel before would cut their shutdown short).
        stack.callback(nursery.cancel_scope.cancel)
        network = MemoryNetwork(nursery)
        monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)
        # Hours of mock time: servers heartbeating every second, not every 200 ms, keep the run
        # short (failover is not what these tests look at).
        meta = await stack.enter_async_context(
            open_metaserver(
                listen=None, data_dir=tmp_path / "meta", clock=clock, run_blocking=run_inline, failover_after_ms=5_000
            )
        )
        network.serve(META, meta.serve_stream)
        realtime = await stack.enter_async_context(
            open_realtime_server(
                data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=META, run_blocking=run_inline
            )
        )
        network.serve(realtime.address, realtime.serve_stream)
        delay_server = None
        if scheduler:
            delay_server = await stack.enter_async_context(
                open_scheduler(
                    data_dir=tmp_path / "scheduler", clock=clock, listen=None, advertise_address=SCHEDULER,
                    meta_address=META, run_blocking=run_inline, **scheduler_options,
                )
            )  # fmt: skip
            network.serve(SCHEDULER, delay_server.serve_stream)
        yield Cluster(clock, realtime, delay_server)


@dataclass
class Seen:
    """What one consumer group's handler saw: (id, subject, attempts, received_at)."""

    messages: list[tuple[str, str, int, int]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)

    def add(self, message: ReceivedMessage) -> None:
        self.messages.append((message.id, message.subject, message.attempts, message.received_at))
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.messages) < count:
            await self.changed.wait()


async def run_group(
    cluster: Cluster, subject: str, group: str, seen: Seen, *, fail: bool,
    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED, **options: Any,
) -> None:  # fmt: skip
    """A consumer whose handler records each message and then raises (``fail``) or returns."""

    async def handler(message: ReceivedMessage) -> None:
        seen.add(message)
        if fail:
            raise RuntimeError(f"cannot handle {message.id} (attempt {message.attempts})")

    async with open_consumer(META, subject, group=group, clock=cluster.clock, start="earliest", **options) as consumer:
        task_status.started(consumer)
        await consumer.run(handler)


async def test_immediate_retries_then_the_dead_letter_subject_without_a_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Delay 0 retries go through the realtime server's own log: no scheduler needed."""
    async with open_cluster(tmp_path, monkeypatch, scheduler=False) as cluster, trio.open_nursery() as nursery:
        billing, audit, ops = Seen(), Seen(), Seen()
        await nursery.start(partial(
            run_group, cluster, "orders", "billing", billing, fail=True, retry_delays=(0,), max_attempts=3
        ))  # fmt: skip
        await nursery.start(partial(run_group, cluster, "orders", "audit", audit, fail=False))
        await nursery.start(partial(run_group, cluster, "%dead%billing%orders", "ops", ops, fail=False))
        async with open_producer(META, clock=cluster.clock) as producer:
            message_id = await producer.send("orders", b"flaky")
        with trio.fail_after(600):
            await ops.wait_for(1)
            await audit.wait_for(1)
        await trio.sleep(60)  # (virtual) time for anything else to turn up
        assert [(m[0], m[1], m[2]) for m in billing.messages] == [(message_id, "orders", n) for n in range(3)]
        assert [(m[0], m[1], m[2]) for m in ops.messages] == [(message_id, "%dead%billing%orders", 3)]
        assert [(m[0], m[1], m[2]) for m in audit.messages] == [(message_id, "orders", 0)]
        stats = cluster.realtime.statistics()
        assert (stats.retries_stored, stats.dead_letters, stats.redeliveries) == (2, 1, 0)
        nursery.cancel_scope.cancel()


async def test_nacks_come_back_on_the_backoff_schedule_then_land_in_the_dead_letters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch, scheduler=True) as cluster, trio.open_nursery() as nursery:
        billing, audit, ops = Seen(), Seen(), Seen()
        await nursery.start(partial(
            run_group, cluster, "orders", "billing", billing, fail=True, retry_delays=(5, 10, 30), max_attempts=4
        ))  # fmt: skip
        await nursery.start(partial(run_group, cluster, "orders", "audit", audit, fail=False))
        async with open_producer(META, clock=cluster.clock) as producer:
            message_id = await producer.send("orders", b"flaky")
        with trio.fail_after(3600):
            await billing.wait_for(4)
            await audit.wait_for(1)
        # Every delivery of the message to billing, with when it came.
        assert [(m[0], m[1], m[2]) for m in billing.messages] == [(message_id, "orders", n) for n in range(4)]
        times = [m[3] for m in billing.messages]
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        for gap, delay in zip(gaps, (5 * SECOND, 10 * SECOND, 30 * SECOND), strict=True):
            assert delay <= gap <= delay + 50, (gaps, delay)  # never early, hardly late
        # The fourth attempt's nack buries it: it is consumed from the dead-letter subject.
        await nursery.start(partial(run_group, cluster, "%dead%billing%orders", "ops", ops, fail=False))
        with trio.fail_after(600):
            await ops.wait_for(1)
        ((dead_id, dead_subject, dead_attempts, _),) = ops.messages
        assert (dead_id, dead_subject, dead_attempts) == (message_id, "%dead%billing%orders", 4)
        await trio.sleep(3600)  # (virtual) an hour more: nothing else turns up
        assert len(billing.messages) == 4 and len(ops.messages) == 1
        assert [(m[0], m[1], m[2]) for m in audit.messages] == [(message_id, "orders", 0)]
        stats = cluster.realtime.statistics()
        counts = (stats.retries_scheduled, stats.dead_letters, stats.retries_given_back, stats.redeliveries)
        assert counts == (3, 1, 0, 0)
        assert stats.duplicates == 0
        nursery.cancel_scope.cancel()


async def test_the_default_policy_retries_after_5_s_10_s_and_30_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch, scheduler=True) as cluster, trio.open_nursery() as nursery:
        seen = Seen()

        async def handler(message: ReceivedMessage) -> None:
            seen.add(message)
            if message.attempts < 3:
                raise RuntimeError("not yet")

        async with open_consumer(META, "orders", group="billing", clock=cluster.clock, start="earliest") as consumer:
            nursery.start_soon(consumer.run, handler)
            async with open_producer(META, clock=cluster.clock) as producer:
                await producer.send("orders", b"slow")
            with trio.fail_after(3600):
                await seen.wait_for(4)
            assert await consumer.flush()
            stats = consumer.statistics()
        times = [m[3] for m in seen.messages]
        gaps = [later - earlier for earlier, later in zip(times, times[1:])]
        assert [m[2] for m in seen.messages] == [0, 1, 2, 3]
        for gap, delay in zip(gaps, (5 * SECOND, 10 * SECOND, 30 * SECOND), strict=True):
            assert delay <= gap <= delay + 50, (gaps, delay)
        assert (stats.retried, stats.dead, stats.acked, stats.received_retries) == (3, 0, 1, 3)
        nursery.cancel_scope.cancel()


async def test_the_blocking_consumer_retries_and_buries_too(tmp_path: Path) -> None:
    """Real threads, sockets and clock: immediate retries (delay 0) need no scheduler."""
    clock = SystemClock()
    async with (
        open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta,
        open_realtime_server(
            data_dir=tmp_path / "rt1", clock=clock, group="rt1", meta_address=meta.address, flush="async"
        ),
    ):

        def scenario() -> tuple[str, list[tuple[str, int, str]], list[tuple[str, str, int]]]:
            with BlockingProducer(meta.address) as producer:
                message_id = producer.send("orders", b"flaky")
            seen: list[tuple[str, int, str]] = []
            with BlockingConsumer(
                meta.address, "orders", group="billing", start="earliest", poll_timeout=0.2,
                retry_delays=(0,), max_attempts=2,
            ) as consumer:  # fmt: skip
                for message in consumer.messages(timeout=WAIT):
                    seen.append((message.id, message.attempts, message.pulled_subject))
                    consumer.nack(message)
                    if len(seen) == 2:
                        break
                assert consumer.flush()
            with BlockingConsumer(
                meta.address, "%dead%billing%orders", group="ops", start="earliest", poll_timeout=0.2
            ) as dead:
                letter = dead.receive(timeout=WAIT)
                assert letter is not None
                dead.ack(letter)
            return message_id, seen, [(letter.id, letter.subject, letter.attempts)]

        with trio.fail_after(WAIT * 3):
            message_id, seen, letters = await trio.to_thread.run_sync(scenario)
    assert seen == [(message_id, 0, ""), (message_id, 1, "%retry%billing%orders")]
    assert letters == [(message_id, "%dead%billing%orders", 2)]


async def test_messages_fetched_ahead_reach_the_handler_at_their_moment_never_early_in_fewer_pulls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A scheduler sending 50 ms ahead: a consumer fetching ahead (the default, 0.2 s) holds
    each message until its ``deliver_at`` by its own clock, as one that leaves the holding
    to the server gets it, in the same order, in far fewer pulls (one per SEND, not per tick)."""
    async with (
        open_cluster(tmp_path, monkeypatch, scheduler=True, send_ahead_ms=50, send_interval_ms=20) as cluster,
        trio.open_nursery() as nursery,
    ):
        clock = cluster.clock
        handled: dict[str, list[tuple[str, int, int, int]]] = {"ahead": [], "server": []}
        consumers = {}

        async def consume(name: str, fetch_ahead: float, task_status: trio.TaskStatus[Any]) -> None:
            async with open_consumer(
                META, "orders", group=name, clock=clock, start="earliest", fetch_ahead=fetch_ahead
            ) as consumer:
                consumers[name] = consumer
                task_status.started()
                async for message in consumer:
                    handled[name].append((message.id, message.deliver_at, message.received_at, clock.now_ms()))
                    await message.ack()

        await nursery.start(consume, "ahead", 0.2)
        await nursery.start(consume, "server", 0)
        start = clock.now_ms() + 2 * SECOND
        due = {f"m{n:03d}": start + 7 * n for n in range(300)}  # over about two seconds
        async with open_producer(META, clock=clock) as producer:
            await producer.send_batch([producer.message("orders", b"x", id=i, at=at) for i, at in due.items()])
        with trio.fail_after(60):
            while min(len(seen) for seen in handled.values()) < len(due):
                await trio.sleep(0.1)
        pulls = {name: consumer.statistics().pulls for name, consumer in consumers.items()}
        nursery.cancel_scope.cancel()
    for seen in handled.values():
        assert [m[0] for m in seen] == list(due)  # every one, once, in order
        assert all(deliver_at <= received_at <= now for _id, deliver_at, received_at, now in seen)  # never early
    assert all(received_at - deliver_at <= 1 for _id, deliver_at, received_at, _now in handled["ahead"])  # on time
    assert pulls["ahead"] * 2 < pulls["server"], pulls


async def test_a_cancelled_receive_leaves_the_messages_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """A receive cancelled before it returns (a timeout, a closing nursery) takes nothing:
    the messages already here, and one held until due, go to the next receive."""
    async with (
        open_cluster(tmp_path, monkeypatch, scheduler=True, send_ahead_ms=500, send_interval_ms=20) as cluster,
        open_consumer(META, "orders", group="g", clock=cluster.clock, start="earliest") as consumer,
    ):
        clock = cluster.clock
        due = clock.now_ms() + 5_000
        async with open_producer(META, clock=clock) as producer:
            sent = await producer.send_batch(
                [producer.message("orders", b"now"), producer.message("orders", b"later", at=due)]
            )
        while consumer.statistics().received < 1:  # the first is here, not taken yet
            await trio.sleep(0.01)
        with trio.CancelScope() as scope:
            scope.cancel()
            await consumer.receive()
        with trio.move_on_after(0):  # a timeout that is over before it waits
            await consumer.receive_batch()
        first = await consumer.receive()
        while consumer.statistics().received < 2:  # "later" is fetched 0.2 s ahead, held here
            await trio.sleep(0.01)
        with trio.move_on_after((due - 100 - clock.now_ms()) / 1000):  # times out while it is held
            await consumer.receive()
        assert clock.now_ms() < due
        second = await consumer.receive()
        assert [first.id, second.id] == sent and second.received_at >= second.deliver_at == due
