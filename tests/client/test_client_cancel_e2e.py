"""Cancel, move and query end to end: the producer against a real metaserver, realtime
server and scheduler(s), in-process, under ``autojump_clock``.

Every connection is an in-memory stream (``trio.open_tcp_stream`` is routed to the
servers' ``serve_stream``) and blocking calls run inline, so hours and days of
schedule take no real time. A consumer pulls the subject with raw PULLs and acks at
once, recording when (on the cluster's clock) each message arrived.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.producer import Producer, open_producer
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import TransportError
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import scan_batch
from delaymq.realtime.server import open_realtime_server
from delaymq.scheduler.server import Scheduler, open_scheduler
from delaymq.storage.threads import run_inline

from ..support.polling import wait_until
from ..support.tasks import start_in_nursery

#: 2026-01-01T22:00:00Z: two hours before a UTC day ends, so moves cross hours and days.
EPOCH = 1_767_304_800_000
META = "meta.test:20880"
SLOW_FAILOVER_MS = 5_000
A, B = "sched-a.test:1", "sched-b.test:1"
SECOND = 1_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE


@dataclass
class Arrival:
    id: str
    deliver_at: int
    received_at: int


#: How often (virtual ms) the consumer acks what it pulled since its last ack. An ACK
#: answers once the realtime server's checkpoint is durable (fsyncs), and the scheduler
#: fires each millisecond on its own: an ACK per PULL made the 100,000-message test spend
#: most of its time fsyncing; a real consumer batches its acks too.
ACK_EVERY_MS = 500


@dataclass
class Consumer:
    """Pulls one subject from the realtime server, records arrivals, and acks every
    ``ACK_EVERY_MS`` (well within the ack timeout: an unacked message would come again)."""

    net: MemoryNetwork
    clock: TrioClock
    address: str
    subject: str = "orders"
    got: list[Arrival] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)
    pulled: int = 0  # pull-log position after the last PULL
    acked: int = 0  # pull-log position acked

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ack_loop)
            await self._pull_loop()

    async def _ack_loop(self) -> None:
        base = {"group": "billing", "consumer": "c1", "subject": self.subject}
        while True:
            await self.clock.sleep_ms(ACK_EVERY_MS)
            end = self.pulled
            if end > self.acked:
                try:
                    await self.net.call(self.address, Command.ACK, {**base, "start": self.acked, "end": end})
                except (TransportError, PeerError):
                    continue  # the next round acks it
                self.acked = end

    async def _pull_loop(self) -> None:
        base = {"group": "billing", "consumer": "c1", "subject": self.subject}
        while True:
            try:
                frame = await self.net.call(
                    self.address, Command.PULL, {**base, "max": 10_000, "timeout_ms": 60_000, "from": "earliest"},
                    timeout=90,
                )  # fmt: skip
            except (TransportError, PeerError):
                await trio.sleep(1)
                continue
            count = frame.metadata["count"]
            if not count:
                continue
            now = self.clock.now_ms()
            batch = scan_batch(frame.body)
            self.got += [Arrival(i, at, now) for i, at in zip(batch.ids, batch.deliver_ats, strict=True)]
            self.changed.set()
            self.changed = trio.Event()
            self.pulled = max(self.pulled, frame.metadata["pull_start"] + count)

    async def wait_for(self, count: int) -> None:
        with trio.fail_after(30 * 86_400):  # virtual seconds: only a hang reaches it
            while len(self.got) < count:
                await self.changed.wait()

    def ids(self) -> Counter[str]:
        return Counter(arrival.id for arrival in self.got)


@dataclass
class Cluster:
    clock: TrioClock
    net: MemoryNetwork
    nursery: trio.Nursery
    tmp: Path
    consumer: Consumer

    @asynccontextmanager
    async def scheduler(self, address: str = A, **options: Any) -> AsyncIterator[Scheduler]:
        """A scheduler member at ``address`` on a data folder of its own (open it again to restart it)."""
        async with open_scheduler(
            data_dir=self.tmp / address, clock=self.clock, listen=None, advertise_address=address,
            meta_address=META, run_blocking=run_inline, **options,
        ) as scheduler:  # fmt: skip
            self.net.serve(address, scheduler.serve_stream)
            try:
                yield scheduler
            finally:
                self.net.remove(address)

    async def start_member(self, address: str, **options: Any) -> Scheduler:
        """A member in the cluster's nursery: its ``crash()`` ends only its own task."""
        member: Scheduler = await start_in_nursery(self.nursery, self.scheduler(address, **options))
        return member

    def producer(self) -> Any:
        """A producer whose connections are the network's: taking a server off it breaks them, as a kill would."""
        return open_producer(META, clock=self.clock, batch_messages=10_000, send_timeout=60, peers=self.net)


@asynccontextmanager
async def open_cluster(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, *, flush: str = "sync", **meta_options: Any
) -> AsyncIterator[Cluster]:
    """``flush``: the realtime server's (``async`` where fsyncs would only slow a big test down)."""
    # Days of mock time: servers heartbeating every second, not every 200 ms, keep the run short
    # (failover is not what these tests look at).
    meta_options.setdefault("failover_after_ms", SLOW_FAILOVER_MS)
    clock = TrioClock(EPOCH)
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)  # after the servers above it are closed
        net = MemoryNetwork(nursery, timeout=60)
        monkeypatch.setattr(trio, "open_tcp_stream", net.open_tcp_stream)
        meta = await stack.enter_async_context(
            open_metaserver(listen=None, data_dir=tmp / "meta", clock=clock, run_blocking=run_inline, **meta_options)
        )
        net.serve(META, meta.serve_stream)
        realtime = await stack.enter_async_context(
            open_realtime_server(data_dir=tmp / "rt1", clock=clock, group="rt1", meta_address=META,
                                 run_blocking=run_inline, flush=flush)
        )  # fmt: skip
        net.serve(realtime.address, realtime.serve_stream)
        consumer = Consumer(net, clock, realtime.address)
        nursery.start_soon(consumer.run)
        yield Cluster(clock, net, nursery, tmp, consumer)


def states(answer: list[Any]) -> dict[str, str]:
    return {state.id: state.state for state in answer}


# ---------------------------------------------------------------------------


async def test_cancelling_1000_of_100_000_by_id_and_by_key_leaves_exactly_the_others_on_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    count = 100_000
    async with (
        open_cluster(tmp_path, monkeypatch, flush="async") as cluster,
        cluster.scheduler(flush="async"),
        cluster.producer() as producer,
    ):
        clock = cluster.clock
        start = clock.now_ms() + MINUTE
        rng = random.Random(14)
        # Due over 20 s; message n carries key order-(n // 2), so each key names two messages.
        due = [start + rng.randrange(20 * SECOND) for _ in range(count)]
        batch = [producer.message("orders", b"x", at=at, key=f"order-{n // 2}") for n, at in enumerate(due)]
        ids = await producer.send_batch(batch)
        assert {sent.group for sent in ids} == {"scheduler-1"}
        assert clock.now_ms() < start

        by_id = rng.sample(range(0, count, 2), 500)  # even n: their key-mates stay
        cancelled = await producer.cancel([ids[n] for n in by_id])
        assert [(s.id, s.state, s.deliver_at) for s in cancelled] == [(ids[n], "cancelled", due[n]) for n in by_id]
        keys = rng.sample(sorted({n // 2 for n in range(count)} - {n // 2 for n in by_id}), 250)
        for key in keys:
            answer = await producer.cancel(subject="orders", key=f"order-{key}")
            assert states(answer) == {ids[2 * key]: "cancelled", ids[2 * key + 1]: "cancelled"}
        gone = {ids[n] for n in by_id} | {ids[2 * k + i] for k in keys for i in (0, 1)}
        assert len(gone) == 1_000
        # Asked again: still cancelled, and a key of cancelled messages names them as cancelled.
        assert set(states(await producer.query(list(gone))).values()) == {"cancelled"}
        assert states(await producer.cancel(subject="orders", key=f"order-{keys[0]}")) == {
            ids[2 * keys[0]]: "cancelled", ids[2 * keys[0] + 1]: "cancelled",
        }  # fmt: skip

        await cluster.consumer.wait_for(count - 1_000)
        await clock.sleep_until_ms(start + 2 * MINUTE)  # anything else would have come by now
        got = cluster.consumer.ids()
        assert set(got) == set(ids) - gone
        assert max(got.values()) == 1
        due_of = {message_id: at for message_id, at in zip(ids, due, strict=True)}
        lateness = [a.received_at - due_of[a.id] for a in cluster.consumer.got]
        assert min(lateness) >= 0  # never early
        assert max(lateness) < SECOND  # on time (virtual clock: the machine's speed does not count)

        # After delivery: a cancel says "delivered", with when.
        delivered = [ids[n] for n in range(1, 50, 2)]
        for state in await producer.cancel(delivered):
            assert state.state == "delivered"
            assert state.dispatched_at is not None and state.dispatched_at >= due_of[state.id]
        [where] = await producer.query(ids[1])
        assert (where.state, where.group, where.deliver_at) == ("delivered", "scheduler-1", due_of[ids[1]])
        assert states(await producer.cancel(["no-such-id"])) == {"no-such-id": "unknown"}


async def test_a_message_moved_earlier_or_later_across_hours_and_days_arrives_once_at_its_new_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch) as cluster, cluster.scheduler(), cluster.producer() as producer:
        now = cluster.clock.now_ms()  # 22:00 UTC
        plans = {  # name: (first due time, new due time)
            "later-same-hour": (now + 10 * MINUTE, now + 40 * MINUTE),
            "later-next-hour": (now + 10 * MINUTE, now + 70 * MINUTE + 7),
            "earlier-prev-hour": (now + 90 * MINUTE, now + 20 * MINUTE),
            "later-next-day": (now + 100 * MINUTE, now + 2 * HOUR + 30 * MINUTE),  # 23:40 -> 00:30
            "earlier-prev-day": (now + 3 * HOUR, now + 30 * MINUTE),  # 01:00 -> 22:30
            "by-key": (now + 50 * MINUTE, now + 2 * HOUR + 45 * MINUTE),  # 22:50 -> 00:45
            "to-the-past": (now + 3 * HOUR + 30 * MINUTE, now - HOUR),  # "deliver now"
        }
        sent = {}
        for name, (first, _) in plans.items():
            key = "flight-77" if name == "by-key" else None
            sent[name] = await producer.send("orders", name, at=first, id=name, key=key)
        moved_at = cluster.clock.now_ms()
        for name, (_, new) in plans.items():
            if name == "by-key":
                answer = await producer.move(subject="orders", key="flight-77", at=new)
            else:
                answer = await producer.move(name, at=new, group=sent[name].group)
            assert [(s.id, s.state) for s in answer] == [(name, "moved")]
            if name == "to-the-past":  # a time past means now
                assert moved_at <= answer[0].deliver_at <= cluster.clock.now_ms()
            else:
                assert answer[0].deliver_at == new
        [later] = await producer.query("later-next-day")
        assert (later.state, later.deliver_at, later.hour) == (
            "scheduled",
            now + 150 * MINUTE,
            (now + 150 * MINUTE) // HOUR,
        )

        await cluster.consumer.wait_for(len(plans))
        await cluster.clock.sleep_until_ms(now + 3 * HOUR + 31 * MINUTE)  # past every first due time too
        assert cluster.consumer.ids() == Counter(plans.keys())  # each once: the old due time fired nothing
        for arrival in cluster.consumer.got:
            new = max(plans[arrival.id][1], moved_at)
            assert new <= arrival.received_at < new + SECOND, arrival
        # Moving a delivered message is too late, and says so.
        [late] = await producer.move("later-same-hour", delay=3_600)
        assert late.state == "delivered" and late.dispatched_at is not None


async def test_a_cancel_holds_when_the_scheduler_is_killed_and_started_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_cluster(tmp_path, monkeypatch) as cluster, cluster.producer() as producer:
        now = cluster.clock.now_ms()
        names = [f"r{i}" for i in range(40)]
        gone = set(names[:10]) | {names[i] for i in range(3, 40, 4)}
        async with cluster.scheduler() as scheduler:
            for i, name in enumerate(names):
                await producer.send("orders", name, id=name, at=now + 10 * MINUTE + i * SECOND, key=f"k{i % 4}")
            answer = await producer.cancel(names[:10]) + await producer.cancel(subject="orders", key="k3")
            assert states(answer) == dict.fromkeys(gone, "cancelled")
            scheduler.crash()  # right after the answers, as a SIGKILL: nothing more written
            await trio.sleep_forever()  # cancelled by the crash, as the process would be
        assert scheduler.crashed
        async with cluster.scheduler():  # the same data folder
            assert states(await producer.query(names)) == {n: "cancelled" if n in gone else "scheduled" for n in names}
            await cluster.consumer.wait_for(len(names) - len(gone))
            await cluster.clock.sleep_until_ms(now + 15 * MINUTE)
        assert cluster.consumer.ids() == Counter(set(names) - gone)


async def test_a_cancel_on_the_master_is_honoured_by_the_slave_promoted_after_it_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with (
        open_cluster(tmp_path, monkeypatch, failover_after_ms=5_000) as cluster,
        cluster.producer() as producer,
    ):
        master = await cluster.start_member(A, min_insync=1)
        slave = await cluster.start_member(B, min_insync=1)
        await wait_until(lambda: master.role == "master" and slave.role == "slave", timeout=600, interval=0.05)
        await wait_until(lambda: master.replica_info().get("in_sync") == [B], timeout=600, interval=0.05)
        now = cluster.clock.now_ms()
        names = [f"p{i}" for i in range(30)]
        for i, name in enumerate(names):
            await producer.send("orders", name, id=name, at=now + 10 * MINUTE + i * SECOND, key=f"k{i % 3}")
        answer = await producer.cancel(names[:5]) + await producer.cancel(subject="orders", key="k2")
        gone = set(names[:5]) | {names[i] for i in range(2, 30, 3)}
        assert states(answer) == dict.fromkeys(gone, "cancelled")
        master.crash()
        cluster.net.remove(A)
        await wait_until(lambda: slave.role == "master", timeout=600, interval=0.05)
        assert states(await producer.query(names)) == {n: "cancelled" if n in gone else "scheduled" for n in names}
        await cluster.consumer.wait_for(len(names) - len(gone))
        await cluster.clock.sleep_until_ms(now + 20 * MINUTE)
        assert cluster.consumer.ids() == Counter(set(names) - gone)


async def test_the_blocking_producer_has_the_trio_producers_cancel_move_and_query() -> None:
    import inspect

    from delaymq.client.blocking import BlockingProducer

    for name in ("cancel", "move", "query"):
        trio_parameters = list(inspect.signature(getattr(Producer, name)).parameters)
        assert list(inspect.signature(getattr(BlockingProducer, name)).parameters) == trio_parameters
