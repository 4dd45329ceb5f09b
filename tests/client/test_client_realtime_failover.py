"""Clients across a realtime failover: consumers and producers follow the group to its new master.

A realtime group here is two fake members (``Member``, a ``FrameServer`` each) over one
``Shared`` state: what sync replication gives the real servers (the promoted slave holds
the consumer's pull log, acks and redelivery counts as the old master had them). The
metaserver is the real one; a failover is the new master registering for the group,
which moves the consumer and producer routes to its address. Every connection is an
in-memory stream (``trio.open_tcp_stream`` goes to ``MemoryNetwork``) and blocking calls
run inline, so the tests run under ``autojump_clock``.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client import ReceivedMessage, open_consumer, open_producer
from delaymq.client.delivery import PULL_BACKOFF, SETTLE_INTERVAL
from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.connection import PeerUnavailable
from delaymq.net.requests import Request
from delaymq.net.server import FrameServer
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import RemoteProtocolError
from delaymq.protocol.records import Message, decode_batch, encode_batch
from delaymq.storage.threads import run_inline

from ..support import polling

EPOCH = 1_767_225_600_000
META = "meta.test:20880"
OLD = "old.test:20881"
NEW = "new.test:20881"
SUBJECT = "orders"
GROUP = "billing"
ACK_TIMEOUT = 60.0  # seconds after a failover before the fake gives back what is still not acked


@dataclass
class Shared:
    """What every member of the fake group holds: the subject's messages and one consumer's pull log."""

    messages: list[Message] = field(default_factory=list)
    position: int = 0  # the group's read position in the subject
    queue: deque[int] = field(default_factory=deque)  # message numbers given back, to hand out again
    redeliveries: Counter[int] = field(default_factory=Counter)  # per message number
    pull_log: list[int] = field(default_factory=list)  # message number of each hand-out
    acked: set[int] = field(default_factory=set)  # pull-log sequences
    given_back: set[int] = field(default_factory=set)  # pull-log sequences
    stored_ids: list[str] = field(default_factory=list)  # SENDs stored, in order
    changed: trio.Event = field(default_factory=trio.Event)

    def add(self, *bodies: str) -> None:
        for body in bodies:
            self.messages.append(Message(f"m{len(self.messages)}", SUBJECT, body=body.encode()))
        self._wake()

    def hand_out(self, most: int) -> tuple[int, list[Message]]:
        start = len(self.pull_log)
        out: list[Message] = []
        while len(out) < most and (self.queue or self.position < len(self.messages)):
            if self.queue:
                number = self.queue.popleft()
            else:
                number, self.position = self.position, self.position + 1
            self.pull_log.append(number)
            message = self.messages[number]
            out.append(Message(message.id, SUBJECT, body=message.body, attempts=self.redeliveries[number]))
        return start, out

    def acked_prefix(self) -> int:
        prefix = 0
        while prefix in self.acked or prefix in self.given_back:
            prefix += 1
        return prefix

    def give_back_unacked(self) -> int:
        """The ack timeout: hand-outs not acked go back to the group, their redeliveries raised."""
        count = 0
        for sequence, number in enumerate(self.pull_log):
            if sequence not in self.acked and sequence not in self.given_back:
                self.given_back.add(sequence)
                self.redeliveries[number] += 1
                self.queue.append(number)
                count += 1
        self._wake()
        return count

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()


@dataclass(eq=False)
class Member:
    """One realtime server of the group: serves only while master; ``frozen`` answers nothing (SIGSTOP)."""

    address: str
    shared: Shared
    master: bool = False
    frozen: bool = False
    crashed: bool = False
    acks: list[tuple[int, int]] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    request_times: dict[str, list[float]] = field(default_factory=dict)
    send_ids: list[list[str]] = field(default_factory=list)  # the ids of each SEND received
    on_send: Callable[[Member, list[str]], Any] | None = None
    ack_delay: float = 0.0  # how long an ACK takes (a real server's checkpoint)
    acks_on_the_way: int = 0
    most_acks_on_the_way: int = 0
    _scopes: set[trio.CancelScope] = field(default_factory=set)

    def server(self) -> FrameServer:
        return FrameServer({
            Command.PULL: self.pull, Command.ACK: self.ack, Command.NACK: self.nack,
            Command.CONSUMER_HEARTBEAT: self.heartbeat, Command.SEND: self.send,
        })  # fmt: skip

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                await self.server().serve_stream(stream)
            finally:
                self._scopes.discard(scope)

    def crash(self, network: MemoryNetwork) -> None:
        """As a killed process: every connection breaks, nothing answers any more."""
        self.crashed, self.master = True, False
        network.take_down(self.address)
        for scope in list(self._scopes):
            scope.cancel()

    async def _admit(self, name: str) -> None:
        self.requests[name] += 1
        self.request_times.setdefault(name, []).append(trio.current_time())
        if self.frozen:
            await trio.sleep_forever()
        if not self.master:
            self.refused[name] += 1
            raise RemoteProtocolError(f"{self.address} is not the master of group rt1", code="not_master")

    async def pull(self, request: Request) -> tuple[dict[str, Any], bytes]:
        await self._admit("PULL")
        metadata = request.metadata
        if metadata["subject"] != SUBJECT:  # the group's retry subject: nothing comes back there
            await trio.sleep(metadata["timeout_ms"] / 1000)
            return {"pull_start": 0, "count": 0, "acked": 0}, b""
        start, messages = self.shared.hand_out(metadata["max"])
        if not messages:
            with trio.move_on_after(metadata["timeout_ms"] / 1000):
                await self.shared.changed.wait()
            await self._admit("PULL (after waiting)")
            start, messages = self.shared.hand_out(metadata["max"])
        answer = {"pull_start": start, "count": len(messages), "acked": self.shared.acked_prefix()}
        return answer, encode_batch(messages)

    async def ack(self, request: Request) -> dict[str, Any]:
        await self._admit("ACK")
        self.acks_on_the_way += 1
        self.most_acks_on_the_way = max(self.most_acks_on_the_way, self.acks_on_the_way)
        try:
            await trio.sleep(self.ack_delay)
        finally:
            self.acks_on_the_way -= 1
        start, end = request.metadata["start"], request.metadata["end"]
        self.acks.append((start, end))
        self.shared.acked.update(range(start, end))
        return {}

    async def nack(self, request: Request) -> dict[str, Any]:
        await self._admit("NACK")
        return {}

    async def heartbeat(self, request: Request) -> dict[str, Any]:
        await self._admit("CONSUMER_HEARTBEAT")
        return {}

    async def send(self, request: Request) -> dict[str, Any]:
        ids = [message.id for message in decode_batch(request.body)]
        self.send_ids.append(ids)
        await self._admit("SEND")
        if self.on_send is not None:
            await self.on_send(self, ids)
        results = []
        for message_id in ids:
            results.append("duplicate" if message_id in self.shared.stored_ids else "stored")
            if message_id not in self.shared.stored_ids:
                self.shared.stored_ids.append(message_id)
        return {"results": results}


@dataclass
class World:
    network: MemoryNetwork
    clock: TrioClock
    shared: Shared
    old: Member
    new: Member

    async def make_master(self, member: Member) -> None:
        """The metaserver's word: ``member`` masters group rt1 (the route moves to its address)."""
        member.master = True
        info = {"group": "rt1", "kind": "realtime", "role": "master", "address": member.address, "version": "test"}
        try:
            await self.network.call(META, Command.REGISTER, info)
        except PeerUnavailable:  # the metaserver closed this test's idle connection: a new one
            await self.network.call(META, Command.REGISTER, info)

    async def fail_over(self) -> None:
        """The new master takes over; what is not acked ACK_TIMEOUT later is given back."""
        await self.make_master(self.new)


@asynccontextmanager
async def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[World]:
    clock = TrioClock(EPOCH)
    async with (
        open_metaserver(
            listen=None, data_dir=tmp_path / "meta", clock=clock, run_blocking=run_inline,
            evict_after_ms=3_600_000, heartbeat_interval_ms=5_000,
        ) as meta,
        trio.open_nursery() as nursery,
    ):  # fmt: skip
        network = MemoryNetwork(nursery)
        monkeypatch.setattr(trio, "open_tcp_stream", network.open_tcp_stream)
        network.serve(META, meta.serve_stream)
        shared = Shared()
        old, new = Member(OLD, shared), Member(NEW, shared)
        network.serve(OLD, old.serve_stream)
        network.serve(NEW, new.serve_stream)
        w = World(network, clock, shared, old, new)
        await w.make_master(old)
        yield w
        nursery.cancel_scope.cancel()


#: Wait (virtual time) until a condition holds, looking every 50 ms; fails the test after ``timeout`` (120) seconds.
wait_until = partial(polling.wait_until, interval=0.05)


async def receive(consumer: Any, count: int, *, within: float = 120.0) -> list[ReceivedMessage]:
    with trio.fail_after(within):
        return [await consumer.receive() for _ in range(count)]


def consumer_options(w: World, **options: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"group": GROUP, "clock": w.clock, "poll_timeout": 5, "heartbeat_interval": 1.0}
    settings.update(options)
    return settings


# ------------------------------------------------------------------ consumer


@pytest.mark.parametrize("fault", ["demoted", "crashed"])
async def test_acks_not_delivered_before_a_failover_reach_the_new_master_and_nothing_acked_comes_back(
    fault: str, autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(tmp_path, monkeypatch) as w:
        w.shared.add(*(f"body {n}" for n in range(6)))
        async with open_consumer(META, SUBJECT, **consumer_options(w)) as consumer:
            first = await receive(consumer, 6)
            assert [m.id for m in first] == [f"m{n}" for n in range(6)]
            for message in first[:2]:
                await message.ack()
            await wait_until(lambda: w.shared.acked == {0, 1})
            assert w.old.acks == [(0, 2)]
            # The master goes: a demoted one refuses with not_master, a crashed one does not answer.
            if fault == "demoted":
                w.old.master = False
            else:
                w.old.crash(w.network)
            for message in first[2:4]:
                await message.ack()
            await wait_until(lambda: consumer.statistics().settle_failures >= 1)
            if fault == "demoted":
                assert w.old.refused["ACK"] >= 1
            await trio.sleep(20)  # the metaserver has not moved the route yet: the acks wait, queued
            assert w.shared.acked == {0, 1}
            await w.fail_over()
            # The acks of hand-outs the old master made reach the new one (same pull log).
            await wait_until(lambda: w.shared.acked == {0, 1, 2, 3}, timeout=ACK_TIMEOUT / 2)
            assert w.new.acks == [(2, 4)]
            await trio.sleep(ACK_TIMEOUT / 2)
            assert w.new.requests["CONSUMER_HEARTBEAT"] >= ACK_TIMEOUT / 2 - 2  # every second, there too
            assert w.shared.give_back_unacked() == 2  # the ack timeout on the new master: m4 and m5
            again = await receive(consumer, 2)
            assert [(m.id, m.attempts, m.sequence) for m in again] == [("m4", 1, 6), ("m5", 1, 7)]
            for message in again:
                await message.ack()
            w.shared.add("after the failover")
            (late,) = await receive(consumer, 1)
            assert (late.id, late.attempts, late.sequence) == ("m6", 0, 8)
            await late.ack()
            await wait_until(lambda: w.shared.acked_prefix() == 9)
            # Nothing acked came back: m0..m3 were handed out once, m4 and m5 twice (marked).
            assert Counter(w.shared.pull_log) == Counter({0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 1})
            assert w.old.requests["ACK"] == 1 + w.old.refused["ACK"]  # only the first ack was taken there
            stats = consumer.statistics()
            # m0..m3, m4 and m5 again, m6; the first hand-outs of m4 and m5 are still held (never settled).
            assert (stats.acked, stats.nacked, stats.gaps_nacked, stats.held_messages) == (7, 0, 0, 2)


async def test_acks_refused_as_not_master_are_retried_with_growing_waits_and_route_asks_are_paced(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master that refuses and a metaserver that never moves the route: no tight loop anywhere."""
    async with world(tmp_path, monkeypatch) as w:
        w.shared.add("one", "two")
        async with open_consumer(META, SUBJECT, **consumer_options(w)) as consumer:
            messages = await receive(consumer, 2)
            w.old.master = False
            routes_before = w.network.calls[META]
            for message in messages:
                await message.ack()
            await trio.sleep(300)
            ack_times = w.old.request_times["ACK"]
            waits = [later - earlier for earlier, later in zip(ack_times, ack_times[1:])]
            assert len(ack_times) >= 20  # still trying
            assert min(waits[8:]) >= 2.0  # grown to seconds, not a tight loop
            pulls = w.old.request_times["PULL"]
            floor = PULL_BACKOFF.maximum_ms / 2 / 1000  # a wait at the cap is at least half of it
            assert len(pulls) <= 2 * 300 / floor + 20  # two lanes, each backing off to its cap
            assert w.network.calls[META] - routes_before <= 310  # about one route ask a second at most
            assert w.shared.acked == set()
            # The route moves at last: the acks queued all this time are delivered.
            await w.fail_over()
            await wait_until(lambda: w.shared.acked == {0, 1}, timeout=10)
            assert consumer.statistics().held_messages == 0


async def test_a_long_poll_held_by_a_frozen_master_is_given_up_when_the_route_moves(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGSTOP: the old master's connection stays open and answers nothing; the consumer moves on."""
    async with world(tmp_path, monkeypatch) as w:
        async with open_consumer(
            META, SUBJECT, **consumer_options(w, poll_timeout=30, heartbeat_interval=5, route_refresh=10)
        ) as consumer:
            await wait_until(lambda: w.old.requests["PULL"] >= 2)  # both lanes parked in a long poll
            w.old.frozen = True
            await w.fail_over()
            w.shared.add("after the failover")
            start = trio.current_time()
            (message,) = await receive(consumer, 1)
            # The route refresh (10 s) moves the consumer, not the 40 s the long poll may take.
            assert message.id == "m0" and trio.current_time() - start <= 12
            await message.ack()
            await wait_until(lambda: w.shared.acked == {0})
            assert w.new.acks == [(0, 1)]


async def test_a_consumer_closing_during_a_failover_delivers_its_acks_to_the_new_master(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(tmp_path, monkeypatch) as w:
        w.shared.add("one", "two", "three")
        async with open_consumer(META, SUBJECT, **consumer_options(w, flush_timeout=10)) as consumer:
            messages = await receive(consumer, 3)
            w.old.crash(w.network)
            for message in messages[:2]:
                await message.ack()

            async def fail_over_soon() -> None:
                await trio.sleep(2)
                await w.fail_over()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail_over_soon)
            # The block ends: the acks go to the new master, m2 (held, not acked) is given back.
        assert w.shared.acked == {0, 1}
        assert w.new.acks == [(0, 2)]


async def test_acks_of_messages_handled_one_by_one_travel_as_a_few_ranges(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ACK costs the server a checkpoint: a round goes at most every SETTLE_INTERVAL."""
    async with world(tmp_path, monkeypatch) as w:
        w.shared.add(*(f"order {n}" for n in range(50)))
        async with open_consumer(META, SUBJECT, **consumer_options(w)) as consumer:
            for message in await receive(consumer, 50):
                await trio.sleep(0.01)  # the application's work on it
                await message.ack()
            await wait_until(lambda: w.shared.acked == set(range(50)))
        ack_times = w.old.request_times["ACK"]
        assert len(ack_times) <= 50 * 0.01 / SETTLE_INTERVAL + 2  # not one per message
        assert all(b - a >= SETTLE_INTERVAL - 1e-6 for a, b in itertools.pairwise(ack_times))
        assert w.old.acks == sorted(w.old.acks) and sum(end - start for start, end in w.old.acks) == 50


async def test_the_ranges_of_one_round_are_on_the_way_together(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acks out of order make several ranges: they share the server's checkpoint, not one each in turn."""
    async with world(tmp_path, monkeypatch) as w:
        w.old.ack_delay = 0.5
        w.shared.add(*(f"order {n}" for n in range(10)))
        async with open_consumer(META, SUBJECT, **consumer_options(w)) as consumer:
            held = await receive(consumer, 10)
            for message in held[::2]:  # five ranges: [0, 1), [2, 3), ...
                await message.ack()
            await wait_until(lambda: w.shared.acked == {0, 2, 4, 6, 8}, timeout=0.9)  # sent in turn: 2.5 s
            assert w.old.most_acks_on_the_way == 5
            for message in held[1::2]:
                await message.ack()
            await wait_until(lambda: w.shared.acked == set(range(10)))


# ------------------------------------------------------------------ producer


async def test_a_send_refused_as_not_master_is_stored_once_on_the_new_master_with_the_same_ids(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with world(tmp_path, monkeypatch) as w:
        w.old.master = False  # demoted; the metaserver moves the route 3 s later

        async def fail_over_soon() -> None:
            await trio.sleep(3)
            await w.fail_over()

        async with trio.open_nursery() as nursery, open_producer(META, clock=w.clock) as producer:
            nursery.start_soon(fail_over_soon)
            ids = await producer.send_batch([producer.message(SUBJECT, f"order {n}") for n in range(3)])
        assert w.old.refused["SEND"] >= 1 and all(sent == ids for sent in w.old.send_ids)
        assert w.new.send_ids == [ids]
        assert w.shared.stored_ids == ids
        assert producer.statistics().duplicates == 0


async def test_a_send_whose_answer_died_with_the_master_is_answered_duplicate_by_the_new_one(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old master stored (and replicated) the batch, then was killed before answering."""
    async with world(tmp_path, monkeypatch) as w:

        async def store_then_die(member: Member, ids: list[str]) -> None:
            w.shared.stored_ids.extend(ids)
            await w.fail_over()
            member.crash(w.network)  # this request's connection too: no answer goes out
            await trio.sleep_forever()

        w.old.on_send = store_then_die
        async with open_producer(META, clock=w.clock) as producer:
            ids = await producer.send_batch([producer.message(SUBJECT, f"order {n}") for n in range(3)])
        assert w.old.send_ids == [ids] and w.new.send_ids == [ids]
        assert w.shared.stored_ids == ids  # stored once
        assert producer.statistics().duplicates == 3
