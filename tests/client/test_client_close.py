"""A consumer that closes gives back at once what it took and never handed out, ``attempts``
unchanged; a consumer with a ``limit`` never pulls more than it.

The core's part sans-IO; then a real metaserver and realtime server on a ``MemoryNetwork``
under ``autojump_clock`` (the clients' connections reach them through it too), where the
injected clock shows that the next consumer gets the messages long before the ack timeout.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from delaymq.client import ReceivedMessage, open_consumer, open_producer
from delaymq.client.acksender import AckSender
from delaymq.client.delivery import ConsumerCore
from delaymq.client.flow import PullLimit
from delaymq.clock import TrioClock
from delaymq.net.connection import PeerUnavailable
from delaymq.net.requests import Request
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.records import Message, encode_batch
from delaymq.realtime.acks import AckHandler
from delaymq.realtime.pull import PullHandler
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.storage.threads import run_inline

from ..support.network import open_memory_metaserver
from ..support.polling import wait_until

T0 = 1_767_225_600_000
META = "meta.test:20880"
RT = "rt-a.test:20881"
ACK_TIMEOUT_S = 60


def answer(start: int, count: int, acked: int = 0, prefix: str = "m") -> tuple[dict[str, Any], bytes]:
    messages = [
        Message(f"{prefix}{start + n}", "orders", body=b"x", deliver_at=T0, created_at=T0) for n in range(count)
    ]
    return {"pull_start": start, "count": count, "acked": acked}, encode_batch(messages)


def core(**options: Any) -> ConsumerCore:
    consumer = ConsumerCore("orders", group="billing", consumer_id="c1", **options)
    consumer.update_route([("rt1", "127.0.0.1:1")])
    return consumer


# ---------------------------------------------------------------- the core, sans-IO


def test_what_was_never_handed_out_is_released_and_what_was_is_nacked() -> None:
    consumer = core()
    assert consumer.pull_request("rt1") is not None
    held = consumer.accept_pull("rt1", *answer(0, 6), T0)
    consumer.settle(held[0], True)  # handed out and acked; held[1] handed out, not settled
    assert consumer.release(held[2:]) == 4
    assert consumer.release(held[2:]) == 0  # given back already
    assert consumer.release_all() == 1
    assert consumer.release_rest() == 0  # every answer was read
    (settlement,) = consumer.take_pending()
    assert (settlement.releases, settlement.nacks, settlement.acks) == ([(2, 6)], [(1, 2)], [(0, 1)])
    first, *rest = settlement.requests()  # what goes back to the group goes first
    assert consumer.settle_metadata(settlement, first) == {
        "group": "billing", "consumer": "c1", "subject": "orders", "start": 2, "end": 6, "release": True,
    }  # fmt: skip
    assert "release" not in consumer.settle_metadata(settlement, rest[0])
    stats = consumer.statistics()
    assert (stats.released, stats.nacked, stats.acked, stats.held_messages) == (4, 1, 1, 0)


def test_a_pull_whose_answer_went_unread_is_released_to_the_end_of_the_pull_log() -> None:
    consumer = core()
    consumer.pull_request("rt1")
    consumer.accept_pull("rt1", *answer(0, 3), T0)
    consumer.pull_request("rt1")  # on its way when the consumer closes
    consumer.pull_request("rt1", retry=True)  # never answered: where its pull log starts is unknown
    assert consumer.release_rest() == 1
    (settlement,) = consumer.take_pending()
    assert settlement.release_from == 3
    request = settlement.requests()[0]
    metadata = consumer.settle_metadata(settlement, request)
    assert metadata["start"] == 3 and metadata["release"] is True and "end" not in metadata
    assert consumer.unsent() == (0, 0, 0)
    consumer.settle_failed(settlement, [request])  # not delivered: queued again
    assert consumer.unsent() == (0, 1, 0)
    assert consumer.take_pending()[0].release_from == 3


def test_a_refused_pull_handed_nothing_out() -> None:
    consumer = core()
    consumer.pull_request("rt1")
    consumer.accept_pull("rt1", *answer(0, 1), T0)
    consumer.pull_request("rt1")
    consumer.pull_failed("rt1", refused=True)
    assert consumer.release_rest() == 0
    consumer.pull_request("rt1")
    consumer.pull_failed("rt1")  # no answer: it may have been handed some
    assert consumer.release_rest() == 1


def test_a_limit_is_shared_by_the_lanes_and_a_lane_without_room_goes_first() -> None:
    consumer = core(limit=5, pull_batch=10)
    subject, retry = consumer.pull_request("rt1"), consumer.pull_request("rt1", retry=True)
    assert subject is not None and retry is not None
    assert (subject["max"], retry["max"]) == (1, 1)  # no answer yet: one each, polling briefly
    assert subject["timeout_ms"] == retry["timeout_ms"] < consumer.poll_timeout_ms
    consumer.accept_pull("rt1", *answer(0, 1), T0)
    subject = consumer.pull_request("rt1")
    assert subject is not None and subject["max"] == 3  # 5, less 1 pulled, less the retry lane's 1
    consumer.accept_pull("rt1", *answer(1, 3), T0)
    assert consumer.pull_request("rt1") is None  # the last one is the retry lane's for now
    consumer.accept_pull("rt1", *answer(0, 0, prefix="r"), T0, retry=True)
    assert consumer.pull_request("rt1", retry=True) is None  # the subject waits for room: it goes first
    subject = consumer.pull_request("rt1")
    assert subject is not None and subject["max"] == 1
    consumer.accept_pull("rt1", *answer(4, 1), T0)
    assert consumer.limit.reached and consumer.pull_request("rt1") is None
    assert consumer.statistics().received == 5


def test_without_a_limit_pulls_ask_for_a_batch_and_poll_long() -> None:
    consumer = core(pull_batch=10)
    request = consumer.pull_request("rt1", retry=True)
    assert request is not None and (request["max"], request["timeout_ms"]) == (10, consumer.poll_timeout_ms)


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(LocalProtocolError) as refused:
        core(limit=0)
    assert (refused.value.code, refused.value.field) == ("limit", "limit")


LANES = [("rt1", False), ("rt1", True), ("rt2", False), ("rt2", True)]


@given(st.integers(1, 40), st.lists(st.tuples(st.sampled_from(LANES), st.integers(0, 12), st.booleans()), max_size=80))
def test_what_is_pulled_and_asked_for_never_passes_the_limit(
    total: int, steps: list[tuple[tuple[str, bool], int, bool]]
) -> None:
    limit = PullLimit(total)
    asked: dict[tuple[str, bool], int] = {}
    for lane, count, answered in steps:
        if lane not in asked:
            most = limit.reserve(lane, 10)
            if most:
                asked[lane] = most
        elif answered:
            limit.answered(lane, min(count, asked.pop(lane)))  # a server hands out at most the ask
        else:
            asked.pop(lane)
            limit.abandoned(lane)
        assert limit.pulled + sum(asked.values()) <= total


class ScriptedPeers:
    """Answers ACKs and NACKs as sent; a release to the end of a pull log waits for ``answer``
    (or, with ``refuse``, fails as an unreachable server does)."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.sent: list[dict[str, Any]] = []
        self.answer = trio.Event()
        self._refuse = refuse

    async def call(self, address: str, command: int, metadata: dict[str, Any], *_args: Any, **_options: Any) -> None:
        self.sent.append(metadata)
        if "end" not in metadata:
            if self._refuse:
                raise PeerUnavailable(f"cannot connect to {address}", address=address)
            await self.answer.wait()


def closing_in_doubt() -> tuple[ConsumerCore, AckSender]:
    """A consumer closing with an ack, a nack and released messages queued, and a PULL on its way."""
    consumer = core()
    consumer.pull_request("rt1")
    held = consumer.accept_pull("rt1", *answer(0, 6), T0)
    consumer.settle(held[0], True)
    consumer.pull_request("rt1")  # on its way as the consumer stops
    assert consumer.release(held[2:]) == 4 and consumer.release_all() == 1 and consumer.release_rest() == 1
    sender = AckSender(consumer, moved=trio.Event, answered=lambda _group: None, failed=lambda _group, _error: None)
    return consumer, sender


async def test_the_release_to_the_end_of_the_pull_log_is_answered_before_anything_goes_back() -> None:
    """Sent together, a give-back could reach the server first: the consumer's PULL still
    waiting there would be handed it again, and the release to the end give it back twice."""
    consumer, sender = closing_in_doubt()
    peers = ScriptedPeers()
    done: list[bool] = []
    async with trio.open_nursery() as nursery:

        async def send_round() -> None:
            done.append(await sender.send_round(peers))  # type: ignore[arg-type]

        nursery.start_soon(send_round)
        await trio.testing.wait_all_tasks_blocked()
        assert [(m["start"], "end" in m) for m in peers.sent] == [(6, False)]  # alone until answered
        peers.answer.set()
    assert done == [True]
    assert {(m["start"], m.get("end"), m.get("release", False)) for m in peers.sent[1:]} == {
        (2, 6, True), (1, 2, False), (0, 1, False),
    }  # then the rest, together  # fmt: skip
    assert consumer.unsent() == (0, 0, 0)


async def test_what_waits_on_a_release_to_the_end_that_failed_stays_queued_with_it() -> None:
    consumer, sender = closing_in_doubt()
    peers = ScriptedPeers(refuse=True)
    assert not await sender.send_round(peers)  # type: ignore[arg-type]
    assert [m["start"] for m in peers.sent] == [6]
    assert consumer.unsent() == (5, 1, 1)  # nothing sent: 4 released and 1 nacked, the release to the end, an ack
    peers = ScriptedPeers()
    peers.answer.set()
    assert await sender.send_round(peers)  # type: ignore[arg-type]
    assert [m["start"] for m in peers.sent[:1]] == [6] and sorted(m["start"] for m in peers.sent) == [0, 1, 2, 6]
    assert consumer.unsent() == (0, 0, 0)


# ---------------------------------------------------------------- end to end


@asynccontextmanager
async def open_realtime(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[RealtimeServer, TrioClock]]:
    """A metaserver and one realtime server (group rt1) on a memory network the clients dial too."""
    clock = TrioClock(T0)
    async with open_memory_metaserver(tmp, clock, META) as (net, _nursery):
        monkeypatch.setattr(trio, "open_tcp_stream", net.open_tcp_stream)
        async with open_realtime_server(
            data_dir=tmp / "rt", clock=clock, listen=None, advertise_address=RT, meta_address=META,
            group="rt1", run_blocking=run_inline, peers=net, ack_timeout_ms=ACK_TIMEOUT_S * 1000,
        ) as server:  # fmt: skip
            net.serve(RT, server.serve_stream)
            await wait_until(lambda: server.role == "master")
            yield server, clock


async def send(clock: TrioClock, names: list[str]) -> None:
    async with open_producer(META, clock=clock) as producer:
        await producer.send_batch([producer.message("orders", name, id=name) for name in names])


async def take(consumer: Any, count: int) -> list[ReceivedMessage]:
    """``count`` messages, each acked as it comes."""
    got = []
    for _ in range(count):
        message = await consumer.receive()
        await message.ack()
        got.append(message)
    return got


def options(clock: TrioClock, **more: Any) -> dict[str, Any]:
    return {"group": "billing", "start": "earliest", "clock": clock, "fetch_ahead": 0, **more}


async def test_the_next_consumer_gets_at_once_what_a_closed_one_took_and_never_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_realtime(tmp_path, monkeypatch) as (server, clock):
        names = [f"m{n:02}" for n in range(30)]
        await send(clock, names)
        async with open_consumer(META, "orders", **options(clock, pull_batch=10)) as first:
            handled = await take(first, 4)
            unsettled = await first.receive()  # handed out, never acked: nacked at close
            await wait_until(lambda: server.statistics().messages_delivered == 30)  # it took them all
        closed = trio.current_time()
        assert first.statistics().released == 25 and first.statistics().nacked == 1
        async with open_consumer(META, "orders", **options(clock, consumer_id="second")) as second:
            with trio.fail_after(ACK_TIMEOUT_S / 2):
                rest = await take(second, 26)
            assert trio.current_time() - closed < 2  # not the ack timeout
        attempts = {message.id: message.attempts for message in rest}
        assert sorted(attempts) == sorted(names[5:] + [unsettled.id])
        assert attempts == dict.fromkeys(names[5:], 0) | {unsettled.id: 1}  # released ones: unchanged
        assert {message.id for message in handled} == set(names[:4])
        assert server.statistics().redeliveries == 1  # the nacked one only


async def test_what_a_pull_was_handed_as_the_consumer_closed_is_released_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    stuck: list[str] = []
    hand_out = PullHandler._hand_out

    async def answer_never_arrives(self: PullHandler, pull: Any, *args: Any) -> Any:
        answered = await hand_out(self, pull, *args)  # in the pull log by now
        if pull.consumer == "first" and stuck:
            await trio.sleep_forever()  # cancelled when the consumer's connection closes
        return answered

    monkeypatch.setattr(PullHandler, "_hand_out", answer_never_arrives)
    async with open_realtime(tmp_path, monkeypatch) as (server, clock):
        await send(clock, ["a0", "a1"])
        async with open_consumer(META, "orders", **options(clock, consumer_id="first")) as first:
            assert [m.id for m in await take(first, 2)] == ["a0", "a1"]
            stuck.append("from here on")
            names = [f"m{n}" for n in range(8)]
            await send(clock, names)  # the waiting pull is handed these; its answer never comes
            await wait_until(lambda: server.statistics().messages_delivered == 10)
        closed = trio.current_time()
        async with open_consumer(META, "orders", **options(clock, consumer_id="second")) as second:
            rest = await take(second, 8)
            assert trio.current_time() - closed < 2
        assert {message.id: message.attempts for message in rest} == dict.fromkeys(names, 0)
        assert server.statistics().redeliveries == 0


async def test_a_consumer_with_a_limit_pulls_no_more_than_it_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_realtime(tmp_path, monkeypatch) as (server, clock):
        names = [f"m{n:02}" for n in range(50)]
        await send(clock, names)
        limited = options(clock, limit=20, pull_batch=8)
        async with open_consumer(META, "orders", **limited) as first:
            got = [message async for message in first]  # ends by itself after the 20th
            for message in got:
                await message.ack()
        assert len(got) == 20 and server.statistics().messages_delivered == 20
        assert first.statistics().released == 0
        async with open_consumer(META, "orders", **options(clock, limit=30)) as second:
            rest = [message async for message in second]
            for message in rest:
                await message.ack()
        assert [m.id for m in got + rest] == names and {m.attempts for m in rest} == {0}
        assert server.statistics().messages_delivered == 50 and server.statistics().redeliveries == 0


async def test_a_limit_holds_while_messages_keep_arriving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Messages arrive in bursts of random size while the consumer pulls its subject and retry subject."""
    async with open_realtime(tmp_path, monkeypatch) as (server, clock):
        chance = random.Random(7)
        async with open_consumer(META, "orders", **options(clock, limit=37, pull_batch=10)) as consumer:
            async with trio.open_nursery() as nursery:

                async def produce() -> None:
                    for burst in range(12):
                        await send(clock, [f"b{burst}-{n}" for n in range(chance.randint(1, 9))])
                        await trio.sleep(chance.random())

                nursery.start_soon(produce)
                got = [message async for message in consumer]
                nursery.cancel_scope.cancel()
        assert len(got) == 37 and server.statistics().messages_delivered == 37


Hook = Callable[[Any, Request], Awaitable[Any]]


def wrap(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, around: Callable[[Hook, Any, Request], Any]) -> None:
    """Patch handler ``cls.name`` so that ``around(original, self, request)`` runs instead."""
    original = getattr(cls, name)

    async def patched(self: Any, request: Request) -> Any:
        return await around(original, self, request)

    monkeypatch.setattr(cls, name, patched)


def is_release_to_the_end(request: Request) -> bool:
    return request.metadata.get("consumer") == "first" and "end" not in request.metadata


async def close_after_one_of_twenty(
    tmp: Path, monkeypatch: pytest.MonkeyPatch, pulled: Callable[[RealtimeServer], bool]
) -> tuple[list[ReceivedMessage], float, tuple[int, int, int]]:
    """``first`` takes a batch of 20, acks one and closes once ``pulled`` (its next PULL is
    out); ``second`` then takes the other 19. Returns what it got, how soon after the close,
    and the server's messages delivered, released and redelivered."""
    async with open_realtime(tmp, monkeypatch) as (server, clock):
        await send(clock, [f"m{n:02}" for n in range(20)])
        async with open_consumer(META, "orders", **options(clock, consumer_id="first", pull_batch=20)) as first:
            await take(first, 1)
            await wait_until(lambda: pulled(server))
        closed = trio.current_time()
        async with open_consumer(META, "orders", **options(clock, consumer_id="second")) as second:
            with trio.fail_after(ACK_TIMEOUT_S / 2):
                rest = await take(second, 19)
        stats = server.statistics()
        return rest, trio.current_time() - closed, (stats.messages_delivered, stats.released, stats.redeliveries)


async def test_a_closing_consumers_waiting_pull_takes_back_nothing_it_gave_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """Its release to the end of the pull log is held at the server until nothing else moves:
    whatever the close sent with it has arrived by then."""

    async def late_release(original: Hook, handler: Any, request: Request) -> Any:
        if is_release_to_the_end(request):
            await trio.testing.wait_all_tasks_blocked()
        return await original(handler, request)

    wrap(monkeypatch, AckHandler, "nack", late_release)
    # Closed while its PULLs wait at the server: the subject's and the retry subject's.
    rest, after, counts = await close_after_one_of_twenty(
        tmp_path, monkeypatch, lambda server: server.statistics().pulls_waiting == 2
    )
    assert [m.id for m in rest] == [f"m{n:02}" for n in range(1, 20)] and {m.attempts for m in rest} == {0}
    assert after < 2  # not the ack timeout
    assert counts == (20 + 19, 19, 0)  # delivered, released, redelivered


async def test_a_pull_on_its_way_as_the_consumer_closes_takes_back_nothing_it_gave_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """The close's releases go over connections of their own; the consumer's next PULL,
    sent before, reaches the server only after its release to the end of the pull log."""
    held, released = trio.Event(), trio.Event()
    pulls: list[str] = []

    async def late_pull(original: Hook, handler: Any, request: Request) -> Any:
        metadata = request.metadata
        if metadata["consumer"] == "first" and metadata["subject"] == "orders":
            pulls.append("")
            if len(pulls) == 2:
                held.set()
                await released.wait()
        return await original(handler, request)

    async def mark_release(original: Hook, handler: Any, request: Request) -> Any:
        answered = await original(handler, request)
        if is_release_to_the_end(request):
            released.set()
        return answered

    wrap(monkeypatch, PullHandler, "handle", late_pull)
    wrap(monkeypatch, AckHandler, "nack", mark_release)
    rest, after, counts = await close_after_one_of_twenty(tmp_path, monkeypatch, lambda _server: held.is_set())
    assert [m.id for m in rest] == [f"m{n:02}" for n in range(1, 20)] and {m.attempts for m in rest} == {0}
    assert after < 2  # not the ack timeout
    assert counts == (20 + 19, 19, 0)  # delivered, released, redelivered
