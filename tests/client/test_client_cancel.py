"""The producer's cancel, move and query against fake scheduler groups (no servers).

A fake network answers ROUTE as a metaserver would and CANCEL / MOVE / QUERY as the
wire contract says a scheduler group does, from a table of the ids it holds; it can
refuse a group's first tries ("not_master", a failover) or never answer. So these
tests see which groups a call asks, what each request carries, and how answers merge.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.messages import MAX_KEY, SentId, build_message, plan_frames
from delaymq.client.producer import Producer, open_producer
from delaymq.client.routes import CallTimedOut, NoRouteError
from delaymq.client.scheduled import MAX_IDS, MessageState, select
from delaymq.clock import TrioClock
from delaymq.net.connection import PeerUnavailable
from delaymq.net.limits import Limits
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, PeerError
from delaymq.protocol.frames import Frame, FrameKind
from delaymq.protocol.limits import TWO_YEARS_MS
from delaymq.protocol.records import Message, decode_batch

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
META = "meta.test:1"
REALTIME = "rt.test:1"


@dataclass
class FakeGroup:
    """A scheduler group as CANCEL / MOVE / QUERY see it: id -> (state, deliver_at, subject, key)."""

    name: str
    address: str
    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    refuse: int = 0  # the next N requests are refused "not_master"
    down: bool = False
    requests: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def hold(self, message_id: str, state: str = "scheduled", *, deliver_at: int = T0 + 60_000, **more: Any) -> None:
        self.held[message_id] = {"state": state, "deliver_at": deliver_at, **more}

    def answer(self, command: int, metadata: dict[str, Any]) -> dict[str, Any]:
        if "ids" in metadata:
            ids = metadata["ids"]
        else:
            ids = [
                i
                for i, m in self.held.items()
                if (m.get("subject"), m.get("key")) == (metadata["subject"], metadata["key"])
            ]
        results = []
        for message_id in ids:
            held = self.held.get(message_id)
            if held is None:
                results.append({"id": message_id, "state": "unknown"})
                continue
            state = held["state"]
            if state == "scheduled" and command == Command.CANCEL:
                state = held["state"] = "cancelled"
            elif state == "scheduled" and command == Command.MOVE:
                held["deliver_at"] = metadata["deliver_at"]
                state = "moved"
            result = {"id": message_id, "state": state, "deliver_at": held["deliver_at"]}
            if state == "delivered":
                result["dispatched_at"] = held["deliver_at"] + 3
            if command == Command.QUERY:
                result.update(hour=held["deliver_at"] // 3_600_000, group=self.name)
            results.append(result)
        return {"results": results}


class FakeNetwork:
    """An ``AsyncCaller``: a metaserver at META routing the groups, and the groups themselves."""

    def __init__(self, *groups: FakeGroup) -> None:
        self.groups = {group.address: group for group in groups}
        self.calls: Counter[str] = Counter()
        self.scheduled: list[bytes] = []

    async def call(
        self, address: str, command: int, metadata: dict[str, Any] | None = None, body: bytes = b"", *,
        timeout: float | None = None,
    ) -> Frame:  # fmt: skip
        metadata = metadata or {}
        await trio.lowlevel.checkpoint()
        if address == META:
            assert command == Command.ROUTE
            groups = [
                {"group": g.name, "kind": "scheduler", "state": "RW", "address": g.address, "slaves": []}
                for g in self.groups.values()
            ]
            if metadata["route"] != "delayed-producer":
                groups = [{"group": "rt", "kind": "realtime", "state": "RW", "address": REALTIME, "slaves": []}]
            return Frame(FrameKind.RESPONSE, command, 1, {"version": 1, "groups": groups}, b"")
        self.calls[address] += 1
        if address == REALTIME:
            answer = {"results": ["stored"] * len(decode_batch(body))}
            return Frame(FrameKind.RESPONSE, command, 1, answer, b"")
        group = self.groups[address]
        if group.down:
            raise PeerUnavailable(f"{address} is down", address=address)
        if command == Command.SCHEDULE:
            records = decode_batch(body)
            self.scheduled.append(body)
            answer = {"results": ["scheduled"] * len(records), "group": group.name}
            return Frame(FrameKind.RESPONSE, command, 1, answer, b"")
        group.requests.append((command, dict(metadata)))
        if group.refuse:
            group.refuse -= 1
            raise PeerError(f"scheduler of group {group.name} is not master", code="not_master")
        return Frame(FrameKind.RESPONSE, command, 1, group.answer(command, metadata), b"")


def two_groups() -> tuple[FakeGroup, FakeGroup, FakeNetwork]:
    a, b = FakeGroup("sched-a", "a.test:1"), FakeGroup("sched-b", "b.test:1")
    return a, b, FakeNetwork(a, b)


# ------------------------------------------------------------ local checks


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"ids": []}, "ids"),
        ({"ids": ["ok", ""]}, "ids[1]"),
        ({"ids": ["x" * 65]}, "ids[0]"),
        ({"ids": ["a"], "key": "k", "subject": "s"}, "key"),
        ({"subject": "orders"}, "key"),
        ({"key": "order-42"}, "subject"),
        ({"subject": "orders", "key": "k" * (MAX_KEY + 1)}, "key"),
        ({"subject": "orders", "key": "bad\nkey"}, "key"),
        ({}, "ids"),
    ],
)
def test_a_selection_that_cannot_work_is_refused_naming_the_field(arguments: dict[str, Any], field: str) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        select(**arguments)
    assert caught.value.field == field


def test_a_key_is_checked_like_other_fields_and_travels_as_the_property_key() -> None:
    message = build_message("orders", b"x", key="order-42", delay=60, now_ms=T0)
    assert message.properties == {"key": "order-42"}
    [decoded] = decode_batch(plan_frames([message], now_ms=T0).frames[0].body)
    assert decoded.properties["key"] == "order-42"
    with pytest.raises(LocalProtocolError) as caught:
        build_message("orders", b"x", key="k" * (MAX_KEY + 1), now_ms=T0)
    assert (caught.value.field, caught.value.limit) == ("key", MAX_KEY)
    with pytest.raises(LocalProtocolError) as caught:
        build_message("orders", b"x", properties={"key": 42}, now_ms=T0)
    assert caught.value.field == "key"
    with pytest.raises(LocalProtocolError) as caught:
        build_message("orders", b"x", key="a", properties={"key": "b"}, now_ms=T0)
    assert caught.value.field == "key"
    with pytest.raises(LocalProtocolError) as caught:  # a Message built by hand is checked when planned
        plan_frames([Message("id-1", "orders", properties={"key": ""}, deliver_at=T0 + 5)], now_ms=T0)
    assert caught.value.field == "key" and caught.value.index == 0


def test_a_long_list_of_ids_goes_in_requests_of_at_most_max_ids() -> None:
    ids = [f"id-{n}" for n in range(2 * MAX_IDS + 5)]
    requests = select(ids + ids[:10]).requests()  # repeats are asked once
    assert [len(r["ids"]) for r in requests] == [MAX_IDS, MAX_IDS, 5]
    assert [i for r in requests for i in r["ids"]] == ids


# ------------------------------------------------------------ calls


async def test_send_returns_the_scheduler_group_that_stored_a_delayed_message() -> None:
    a = FakeGroup("sched-a", "a.test:1")
    async with open_producer(META, clock=TrioClock(T0), peers=FakeNetwork(a)) as producer:  # type: ignore[arg-type]
        later = await producer.send("orders", b"x", delay=60, key="order-42")
        now = await producer.send("orders", b"y")
    assert isinstance(later, SentId) and isinstance(later, str)
    assert later.group == "sched-a"
    assert now.group is None  # sent for delivery now: no scheduler holds it


async def test_cancel_asks_every_scheduler_group_and_merges_their_answers() -> None:
    a, b, network = two_groups()
    a.hold("only-in-a")
    b.hold("only-in-b")
    b.hold("delivered-in-b", "delivered")
    async with open_producer(META, clock=TrioClock(T0), peers=network) as producer:  # type: ignore[arg-type]
        states = await producer.cancel(["only-in-b", "nowhere", "only-in-a", "delivered-in-b"])
    assert [(s.id, s.state, s.group) for s in states] == [
        ("only-in-b", "cancelled", "sched-b"),
        ("nowhere", "unknown", None),
        ("only-in-a", "cancelled", "sched-a"),
        ("delivered-in-b", "delivered", "sched-b"),
    ]
    assert states[3].dispatched_at == T0 + 60_003
    assert a.held["only-in-a"]["state"] == b.held["only-in-b"]["state"] == "cancelled"


async def test_a_message_delivered_by_one_group_is_delivered_whatever_another_says() -> None:
    """A retried SCHEDULE whose first answer was lost may leave a copy in a second group."""
    a, b, network = two_groups()
    a.hold("twice")
    b.hold("twice", "delivered")
    async with open_producer(META, clock=TrioClock(T0), peers=network) as producer:  # type: ignore[arg-type]
        [state] = await producer.cancel("twice")
    assert (state.state, state.group) == ("delivered", "sched-b")


async def test_a_named_group_is_the_only_one_asked() -> None:
    a, b, network = two_groups()
    b.hold("m1")
    async with open_producer(META, clock=TrioClock(T0), peers=network) as producer:  # type: ignore[arg-type]
        [state] = await producer.query("m1", group="sched-b")
    assert state == MessageState("m1", "scheduled", deliver_at=T0 + 60_000, hour=(T0 + 60_000) // 3_600_000,
                                 group="sched-b")  # fmt: skip
    assert network.calls == {"b.test:1": 1}


async def test_cancel_by_key_returns_each_message_of_the_key_from_every_group() -> None:
    a, b, network = two_groups()
    a.hold("a1", subject="orders", key="order-42")
    b.hold("b1", subject="orders", key="order-42")
    b.hold("b2", subject="orders", key="order-43")
    async with open_producer(META, clock=TrioClock(T0), peers=network) as producer:  # type: ignore[arg-type]
        states = await producer.cancel(subject="orders", key="order-42")
        none = await producer.cancel(subject="orders", key="order-44")
    assert sorted((s.id, s.state) for s in states) == [("a1", "cancelled"), ("b1", "cancelled")]
    assert none == []
    assert b.held["b2"]["state"] == "scheduled"
    assert a.requests[0] == (Command.CANCEL, {"subject": "orders", "key": "order-42"})


async def test_move_sends_the_new_time_and_refuses_one_beyond_the_horizon() -> None:
    a = FakeGroup("sched-a", "a.test:1")
    a.hold("m1")
    async with open_producer(META, clock=TrioClock(T0), peers=FakeNetwork(a)) as producer:  # type: ignore[arg-type]
        [state] = await producer.move("m1", delay=7_200)
        assert (state.state, state.deliver_at) == ("moved", T0 + 7_200_000)
        assert a.requests[-1] == (Command.MOVE, {"ids": ["m1"], "deliver_at": T0 + 7_200_000})
        with pytest.raises(LocalProtocolError) as caught:
            await producer.move("m1", at=T0 + TWO_YEARS_MS + 1)
        assert caught.value.field == "deliver_at"
        with pytest.raises(LocalProtocolError):
            await producer.move("m1")  # no new time
    assert len(a.requests) == 1


async def test_a_failover_refusal_is_retried_on_the_same_group(autojump_clock: trio.testing.MockClock) -> None:
    a, b, network = two_groups()
    b.hold("m1")
    b.refuse = 3
    clock = TrioClock(T0)
    async with open_producer(META, clock=clock, peers=network) as producer:  # type: ignore[arg-type]
        [state] = await producer.cancel("m1")
    assert state.state == "cancelled"
    assert len(b.requests) == 4 and len(a.requests) == 1


async def test_a_group_that_never_answers_fails_the_call_after_send_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """ "Unknown" would be a guess: the message may sit in the group that does not answer."""
    a, b, network = two_groups()
    a.hold("m1")
    b.down = True
    clock = TrioClock(T0)
    async with open_producer(META, clock=clock, peers=network, send_timeout=5) as producer:  # type: ignore[arg-type]
        started = clock.monotonic_ms()
        with pytest.raises(CallTimedOut) as caught:
            await producer.query("m1")
    assert 4_000 <= clock.monotonic_ms() - started <= 5_000
    assert "sched-b" in str(caught.value) and "send_timeout" in str(caught.value)
    assert network.calls["b.test:1"] > 3


async def test_no_scheduler_group_at_all_is_said_at_once() -> None:
    async with open_producer(META, clock=TrioClock(T0), peers=FakeNetwork()) as producer:  # type: ignore[arg-type]
        with pytest.raises(NoRouteError):
            await producer.cancel("m1")


async def test_a_producer_built_without_connections_says_so() -> None:
    producer = Producer(
        None,  # type: ignore[arg-type]
        clock=TrioClock(T0), limits=Limits(),
        batch_bytes=1, batch_messages=1, attempts=1, timeout=1.0,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="open_producer"):
        await producer.cancel("m1")


async def test_an_id_send_returned_names_the_message_again() -> None:
    a = FakeGroup("sched-a", "a.test:1")
    async with open_producer(META, clock=TrioClock(T0), peers=FakeNetwork(a)) as producer:  # type: ignore[arg-type]
        sent = await producer.send("orders", b"x", delay=60)
        a.hold(sent)
        [state] = await producer.cancel(sent, group=sent.group)
        again = await producer.send("orders", b"x", delay=60, id=sent)  # a resend with the same id
    assert (state.id, state.state) == (sent, "cancelled") and type(state.id) is str
    assert again == sent and type(a.requests[0][1]["ids"][0]) is str
