"""The producer without servers: local checks, delivery times, routing and frames.

A fake route client records what would be sent, so these tests see exactly
which route, command and records a send produces.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import trio
from freezegun import freeze_time

from delaymq.client.blocking import BlockingProducer
from delaymq.client.messages import (
    build_message,
    delivery_time,
    plan_frames,
)
from delaymq.client.producer import Producer, open_producer
from delaymq.client.routes import meta_addresses
from delaymq.clock import SystemClock, TrioClock
from delaymq.net.limits import Limits
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, PeerError, RemoteProtocolError
from delaymq.protocol.frames import Frame, FrameKind
from delaymq.protocol.limits import TWO_YEARS_MS
from delaymq.protocol.records import Message, decode_batch
from delaymq.protocol.routes import RouteKind

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
DAY = 86_400_000


class FakeRoutes:
    """Records routed calls and answers them as a server would (or refuses on demand)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, bytes]] = []
        self.refuse: dict[int, PeerError] = {}  # call number -> error

    async def call(self, route: str, command: int, metadata: Any, body: bytes, **_: Any) -> Frame:
        number = len(self.calls)
        self.calls.append((route, command, body))
        if number in self.refuse:
            raise self.refuse[number]
        word = "scheduled" if command == Command.SCHEDULE else "stored"
        results = [word] * len(decode_batch(body))
        return Frame(FrameKind.RESPONSE, command, 1, {"results": results}, b"")

    def statistics(self) -> None:
        return None

    def sent(self) -> list[tuple[str, int, list[Message]]]:
        return [(route, command, decode_batch(body)) for route, command, body in self.calls]


def make_producer(routes: FakeRoutes, clock: Any, **options: Any) -> Producer:
    settings = dict(clock=clock, limits=Limits(), batch_bytes=1 << 20, batch_messages=1000, attempts=3, timeout=1.0)
    settings.update(options)
    return Producer(routes, **settings)  # type: ignore[arg-type]


# ------------------------------------------------------------ local checks


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"subject": "s" * 256}, "subject", 255),
        ({"id": "i" * 65}, "id", 64),
        ({"tags": ["t"] * 17}, "tags", 16),
        ({"tags": ["x" * 65]}, "tag", 64),
        ({"body": b"x" * 11}, "body", 10),
        ({"properties": {"k": "v" * 100}}, "properties", 64),
    ],
)
def test_a_message_breaking_a_limit_is_refused_naming_field_and_limit(
    kwargs: dict[str, Any], field: str, limit: int
) -> None:
    limits = Limits(max_body=10, max_properties=64)
    arguments: dict[str, Any] = {"subject": "orders", "body": b"ok"}
    arguments.update(kwargs)
    subject = arguments.pop("subject")
    body = arguments.pop("body")
    with pytest.raises(LocalProtocolError) as caught:
        build_message(subject, body, now_ms=T0, limits=limits, **arguments)
    assert caught.value.field == field
    assert caught.value.limit == limit
    assert str(limit) in str(caught.value)


async def test_nothing_is_sent_when_one_message_of_a_batch_is_bad() -> None:
    routes = FakeRoutes()
    producer = make_producer(routes, TrioClock(T0))
    good = producer.message("orders", b"fine")
    bad = Message("id-1", "s" * 300, body=b"too long a subject")
    with pytest.raises(LocalProtocolError) as caught:
        await producer.send_batch([good, good, bad])
    assert caught.value.index == 2
    assert caught.value.field == "subject"
    assert "messages[2]" in str(caught.value)
    assert routes.calls == []


def test_delay_and_at_give_deliver_at_from_the_clock() -> None:
    assert delivery_time(delay=90, now_ms=T0) == T0 + 90_000
    assert delivery_time(delay=0.0015, now_ms=T0) == T0 + 2  # rounded up: never early
    assert delivery_time(delay=timedelta(hours=2), now_ms=T0) == T0 + 7_200_000
    at = datetime(2026, 12, 24, 18, 0, tzinfo=UTC)
    assert delivery_time(at=at, now_ms=T0) == int(at.timestamp() * 1000)
    paris = datetime(2026, 12, 24, 19, 0, tzinfo=timezone(timedelta(hours=1)))
    assert delivery_time(at=paris, now_ms=T0) == int(at.timestamp() * 1000)
    assert delivery_time(at=T0 + 5, now_ms=T0) == T0 + 5
    assert delivery_time(now_ms=T0) is None


def test_the_producer_reads_the_time_from_its_clock() -> None:
    with freeze_time("2026-01-01T00:00:00Z"):
        core = BlockingProducer("127.0.0.1:1")
        message = core.message("orders", b"x", delay=timedelta(minutes=1))
        core.close()
    assert message.created_at == T0
    assert message.deliver_at == T0 + 60_000


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"at": datetime(2026, 12, 24, 18, 0)}, "at"),  # naive
        ({"delay": -1}, "delay"),
        ({"delay": float("nan")}, "delay"),
        ({"delay": float("inf")}, "delay"),
        ({"delay": 1.8e305}, "delay"),  # finite, but not in milliseconds (it overflowed)
        ({"delay": "90s"}, "delay"),
        ({"at": "2026-12-24"}, "at"),
        ({"delay": 5, "at": T0}, "at"),
    ],
)
def test_bad_delivery_times_are_refused(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        build_message("orders", b"x", now_ms=T0, **kwargs)
    assert caught.value.field == field


def test_naive_datetime_error_says_to_give_a_timezone() -> None:
    with pytest.raises(LocalProtocolError, match="naive.*timezone"):
        build_message("orders", b"x", now_ms=T0, at=datetime(2026, 12, 24, 18, 0))


def test_beyond_the_horizon_is_refused_naming_the_horizon() -> None:
    assert build_message("orders", b"x", now_ms=T0, delay=TWO_YEARS_MS / 1000).deliver_at == T0 + TWO_YEARS_MS
    with pytest.raises(LocalProtocolError) as caught:
        build_message("orders", b"x", now_ms=T0, delay=TWO_YEARS_MS / 1000 + 0.001)
    assert caught.value.code == "horizon"
    assert caught.value.field == "deliver_at"
    assert caught.value.limit == TWO_YEARS_MS
    assert "732 days" in str(caught.value)
    short = Limits(horizon_ms=DAY)
    with pytest.raises(LocalProtocolError, match="horizon is 1 days"):
        build_message("orders", b"x", now_ms=T0, at=T0 + 2 * DAY, limits=short)


def test_a_batch_message_beyond_the_horizon_is_refused_with_its_index() -> None:
    messages = [Message("a", "s", deliver_at=T0), Message("b", "s", deliver_at=T0 + TWO_YEARS_MS + 1)]
    with pytest.raises(LocalProtocolError) as caught:
        plan_frames(messages, now_ms=T0)
    assert (caught.value.index, caught.value.code) == (1, "horizon")


# --------------------------------------------------------------- routing


async def test_immediate_messages_are_sent_and_delayed_ones_scheduled(autojump_clock: trio.abc.Clock) -> None:
    routes = FakeRoutes()
    clock = TrioClock(T0)
    producer = make_producer(routes, clock)
    now_id = await producer.send("orders", b"now", tags=["a"], properties={"k": 1})
    past_id = await producer.send("orders", b"past", at=T0 - 1000)
    await trio.sleep(10)  # the clock moves: deliver_at follows it
    later_id = await producer.send("orders", "later", delay=90)
    sent = routes.sent()
    assert [(route, command) for route, command, _ in sent] == [
        (RouteKind.IMMEDIATE_PRODUCER, Command.SEND),
        (RouteKind.IMMEDIATE_PRODUCER, Command.SEND),
        (RouteKind.DELAYED_PRODUCER, Command.SCHEDULE),
    ]
    now, past, later = (messages[0] for _, _, messages in sent)
    assert (now.id, now.tags, now.properties, now.body, now.deliver_at, now.created_at) == (
        now_id, ("a",), {"k": 1}, b"now", T0, T0,
    )  # fmt: skip
    assert (past.id, past.deliver_at) == (past_id, T0 - 1000)
    assert (later.id, later.body, later.created_at, later.deliver_at) == (later_id, b"later", T0 + 10_000, T0 + 100_000)


async def test_a_batch_is_split_by_route_and_packed_under_the_limits() -> None:
    routes = FakeRoutes()
    producer = make_producer(routes, TrioClock(T0), batch_messages=3, batch_bytes=1 << 20)
    messages = [producer.message("s", f"m{n}", delay=60 if n % 2 else None) for n in range(10)]
    ids = await producer.send_batch(messages)
    assert ids == [message.id for message in messages]
    assert len(set(ids)) == 10
    sent = routes.sent()
    assert all(len(batch) <= 3 for _, _, batch in sent)
    immediate = [m.id for route, _, batch in sent if route == RouteKind.IMMEDIATE_PRODUCER for m in batch]
    delayed = [m.id for route, _, batch in sent if route == RouteKind.DELAYED_PRODUCER for m in batch]
    assert immediate == ids[0::2]
    assert delayed == ids[1::2]
    stats = producer.statistics()
    assert (stats.messages, stats.immediate, stats.delayed) == (10, 5, 5)


def test_frames_stay_under_the_byte_limit_and_a_big_record_travels_alone() -> None:
    messages = [Message(f"id{n}", "s", body=b"x" * 300, deliver_at=T0) for n in range(10)]
    messages.insert(4, Message("big", "s", body=b"y" * 5000, deliver_at=T0))
    plan = plan_frames(messages, now_ms=T0, max_bytes=1000)
    assert [i for frame in plan.frames for i in frame.indexes] == list(range(11))
    for frame in plan.frames:
        assert len(frame.body) <= 1000 or len(frame) == 1
    assert any(len(frame) == 1 and len(frame.body) > 5000 for frame in plan.frames)
    frame_limit = Limits(max_frame=64 * 1024 + 2000)
    plan = plan_frames(messages[:3], now_ms=T0, max_bytes=1 << 20, limits=frame_limit)
    assert all(len(frame.body) <= 2000 for frame in plan.frames)


def test_messages_without_id_or_created_at_get_them_in_the_plan() -> None:
    plan = plan_frames([Message("", "s"), Message("", "s")], now_ms=T0)
    assert len(set(plan.ids)) == 2 and all(plan.ids)
    (frame,) = plan.frames
    assert [m.created_at for m in decode_batch(frame.body)] == [T0, T0]


async def test_a_server_refusal_names_the_message_of_the_callers_batch() -> None:
    routes = FakeRoutes()
    producer = make_producer(routes, TrioClock(T0), batch_messages=2)
    messages = [producer.message("s", f"m{n}") for n in range(4)]
    routes.refuse[1] = PeerError("body too large", code="limit", field="body", limit=1, index=1)
    with pytest.raises(PeerError) as caught:
        await producer.send_batch(messages)
    assert caught.value.index == 3  # the second record of the second frame


def test_meta_addresses_accepts_one_several_or_a_list() -> None:
    assert meta_addresses("a:1") == ["a:1"]
    assert meta_addresses("a:1, b:2") == ["a:1", "b:2"]
    assert meta_addresses(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="meta"):
        meta_addresses("")


def test_system_clock_is_the_default() -> None:
    producer = BlockingProducer("127.0.0.1:1")
    try:
        assert isinstance(producer.clock, SystemClock)
    finally:
        producer.close()


# ------------------------------------------------------- ids, answers, options


async def test_an_empty_id_is_refused_naming_id_and_none_makes_one() -> None:
    routes = FakeRoutes()
    producer = make_producer(routes, TrioClock(T0))
    with pytest.raises(LocalProtocolError) as caught:
        await producer.send("orders", b"x", id="")
    assert (caught.value.field, caught.value.limit) == ("id", 64)
    assert "id is empty" in str(caught.value) and "None" in str(caught.value)
    with pytest.raises(LocalProtocolError, match="id is empty"):
        producer.message("orders", b"x", id="")
    assert routes.calls == []
    made = await producer.send("orders", b"x", id=None)
    given = await producer.send("orders", b"x", id="order-7")
    assert len(made) == 32 and given == "order-7"
    assert [batch[0].id for _, _, batch in routes.sent()] == [made, "order-7"]


class DuplicateRoutes(FakeRoutes):
    """Answers as a realtime server does a retry of records it already holds."""

    def __init__(self, answers: list[list[str]]) -> None:
        super().__init__()
        self.answers = answers

    async def call(self, route: str, command: int, metadata: Any, body: bytes, **_: Any) -> Frame:
        self.calls.append((route, command, body))
        return Frame(FrameKind.RESPONSE, command, 1, {"results": self.answers.pop(0)}, b"")


async def test_records_answered_duplicate_are_stored_ids_and_counted_as_duplicates() -> None:
    routes = DuplicateRoutes([["duplicate", "stored", "duplicate"], ["duplicate"]])
    producer = make_producer(routes, TrioClock(T0))
    messages = [producer.message("orders", f"m{n}") for n in range(3)]
    assert await producer.send_batch(messages) == [m.id for m in messages]
    assert await producer.send("orders", b"again", id=messages[0].id) == messages[0].id
    stats = producer.statistics()
    assert (stats.messages, stats.duplicates, stats.frames) == (4, 3, 2)


@pytest.mark.parametrize("answer", [["stored", "refused"], ["stored"], ["stored", 1]])
async def test_an_answer_that_does_not_say_every_record_is_held_is_an_error(answer: list[Any]) -> None:
    producer = make_producer(DuplicateRoutes([answer]), TrioClock(T0))
    with pytest.raises(RemoteProtocolError) as caught:
        await producer.send_batch([producer.message("orders", f"m{n}") for n in range(2)])
    assert caught.value.field == "results"
    assert "should be a list of 2 of duplicate, scheduled, stored" in str(caught.value)
    assert producer.statistics().messages == 0


@pytest.mark.parametrize("bad", [0, -5, float("nan"), None])
async def test_send_timeout_must_be_more_than_zero_seconds(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"send_timeout is {bad!r}; it must be a number of seconds more than 0"):
        async with open_producer("127.0.0.1:1", send_timeout=bad):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="send_timeout is"):
        BlockingProducer("127.0.0.1:1", send_timeout=bad)
    assert BlockingProducer("127.0.0.1:1").send_timeout == 30.0


async def test_no_metaserver_is_a_plain_no_route_error_not_an_exception_group() -> None:
    from delaymq.client import open_consumer, open_producer
    from delaymq.client.routes import CallFailed, NoRouteError

    with pytest.raises(NoRouteError):
        async with open_consumer("127.0.0.1:1", "orders", group="g", connect_timeout=0.5):
            pass  # pragma: no cover - the route lookup fails first
    with pytest.raises(CallFailed):  # the producer waits for a route until its send_timeout
        async with open_producer("127.0.0.1:1", send_timeout=0.5) as producer:
            await producer.send("orders", b"x")


def test_a_message_checked_when_built_is_encoded_once_and_sent_as_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """``producer.message`` checks a message by encoding it; sending reuses that record
    (the client's CPU per message), except where properties could have changed since."""
    import delaymq.client.messages as messages
    import delaymq.protocol.records as records

    calls: list[str] = []
    original = records.encode_message

    def counting(id: str, *args: Any, **kwargs: Any) -> bytes:
        calls.append(id)
        return original(id, *args, **kwargs)

    def counting_plain(*args: Any) -> Any:
        message = plain_original(*args)
        calls.append(message.id)  # the fast path encodes a plain message itself
        return message

    monkeypatch.setattr(records, "encode_message", counting)
    plain_original = messages.make_plain_message
    monkeypatch.setattr(messages, "make_plain_message", counting_plain)
    now = 1_750_000_000_000
    plain = build_message("orders", b"body", delay=60, now_ms=now)
    keyed = build_message("orders", b"body", delay=60, key="order-1", now_ms=now)
    keyed.properties["note"] = "added after the check"  # a caller may still change properties
    assert calls == [plain.id, keyed.id]
    plan = plan_frames([plain, keyed], now_ms=now)
    assert calls == [plain.id, keyed.id, keyed.id]  # the plain one is not encoded again
    sent = decode_batch(plan.frames[0].body)
    assert [m.id for m in sent] == [plain.id, keyed.id]
    assert sent[0] == plain and sent[1].properties == {"key": "order-1", "note": "added after the check"}


def test_messages_built_sent_or_received_can_be_copied_and_pickled() -> None:
    import copy
    import pickle

    now = 1_750_000_000_000
    built = build_message("orders", b"body", delay=60, now_ms=now)
    keyed = build_message("orders", b"body", delay=60, key="order-1", now_ms=now)
    [received] = decode_batch(built.encode())
    for message in (built, keyed, received):
        assert copy.copy(message) == message == pickle.loads(pickle.dumps(message))
        assert copy.deepcopy(message).encode() == message.encode()
