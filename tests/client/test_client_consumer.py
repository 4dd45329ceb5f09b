"""The consumer's sans-IO core: ack ranges, the exact tag filter, flow control, PULL answers."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.client.delivery import PULL_BACKOFF, AckTracker, ConsumerCore, FlowControl, ReceivedMessage, TagFilter
from delaymq.net.limits import Limits
from delaymq.protocol.errors import LocalProtocolError, RemoteProtocolError
from delaymq.protocol.ranges import RangeSet
from delaymq.protocol.records import Message, encode_batch, tag_bit, tags_mask

T0 = 1_767_225_600_000


def colliding_tags() -> tuple[str, str]:
    """Two different tags that set the same bit of the server's tag mask."""
    seen: dict[int, str] = {}
    for n in itertools.count():
        tag = f"tag{n}"
        bit = tag_bit(tag)
        if bit in seen:
            return seen[bit], tag
        seen[bit] = tag
    raise AssertionError("unreachable")


def answer(start: int, messages: list[Message], acked: int = 0) -> tuple[dict[str, Any], bytes]:
    return {"pull_start": start, "count": len(messages), "acked": acked}, encode_batch(messages)


def msgs(count: int, *, tags: tuple[str, ...] = (), body: bytes = b"x", prefix: str = "m") -> list[Message]:
    return [Message(f"{prefix}{n}", "orders", tags=tags, body=body, deliver_at=T0, created_at=T0) for n in range(count)]


def core(**options: Any) -> ConsumerCore:
    settings: dict[str, Any] = {"group": "billing", "consumer_id": "c1"}
    settings.update(options)
    consumer = ConsumerCore("orders", **settings)
    consumer.update_route([("rt1", "127.0.0.1:1")])
    return consumer


# ---------------------------------------------------------------- ranges


def test_range_set_merges_out_of_order_additions() -> None:
    ranges = RangeSet()
    for start, end in [(5, 6), (1, 2), (3, 4), (2, 3), (8, 10), (4, 5)]:
        ranges.add(start, end)
    assert ranges.ranges() == [(1, 6), (8, 10)]
    assert 5 in ranges and 6 not in ranges and 9 in ranges
    assert ranges.take() == [(1, 6), (8, 10)]
    assert not ranges


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 8)), max_size=40))
def test_range_set_holds_exactly_the_union(pieces: list[tuple[int, int]]) -> None:
    ranges = RangeSet()
    expected: set[int] = set()
    for start, length in pieces:
        ranges.add(start, start + length)
        expected.update(range(start, start + length))
    assert {n for start, end in ranges.ranges() for n in range(start, end)} == expected
    flat = [edge for pair in ranges.ranges() for edge in pair]
    assert all(a < b for a, b in zip(flat, flat[1:]))  # sorted, disjoint, not touching


def test_out_of_order_acks_merge_and_the_prefix_moves_when_the_hole_fills() -> None:
    tracker = AckTracker()
    assert tracker.handed(0, 6, 0) is None
    for sequence in (3, 1, 4):
        assert tracker.settle(sequence, ack=True)
    assert tracker.acked == 0
    assert tracker.to_ack.ranges() == [(1, 2), (3, 5)]
    assert tracker.settle(0, ack=True)
    assert tracker.acked == 2
    assert tracker.settle(2, ack=True)
    assert tracker.acked == 5
    assert tracker.to_ack.take() == [(0, 5)]  # one ACK range for five acks
    assert tracker.outstanding() == 1
    assert not tracker.settle(2, ack=True)  # twice: no-op
    assert not tracker.settle(6, ack=True)  # never handed
    assert tracker.settle(5, ack=False)
    assert (tracker.acked, tracker.to_nack.ranges(), tracker.to_ack.ranges()) == (6, [(5, 6)], [])


def test_a_sequence_handed_but_never_seen_is_nacked() -> None:
    tracker = AckTracker()
    # An earlier run of this consumer id held [7, 10) and did not ack it.
    assert tracker.handed(10, 2, 7) == (7, 10)
    assert tracker.to_nack.ranges() == [(7, 10)]
    assert tracker.acked == 10
    # A pull whose answer was lost: the next one starts past what we saw.
    assert tracker.handed(15, 1, 10) == (12, 15)
    assert tracker.to_nack.ranges() == [(7, 10), (12, 15)]


def test_a_server_that_renumbers_starts_a_new_epoch() -> None:
    tracker = AckTracker()
    tracker.handed(0, 10, 0)
    tracker.settle(9, ack=True)
    tracker.handed(4, 2, 4)  # the server lost [4, 10) of our pull log
    assert tracker.epoch == 1
    assert tracker.to_ack.ranges() == []  # acks of the old numbering are not sent
    assert (tracker.acked, tracker.end) == (4, 6)


# ------------------------------------------------------------------- tags


def test_tag_filter_is_exact_even_when_tags_share_a_mask_bit() -> None:
    wanted, collider = colliding_tags()
    assert wanted != collider and tags_mask([wanted]) == tags_mask([collider])
    tag_filter = TagFilter([wanted])
    assert tag_filter.matches([wanted])
    assert tag_filter.matches(["other", wanted])
    assert not tag_filter.matches([collider])
    assert not tag_filter.matches([])
    assert TagFilter([]).matches([])  # no filter: everything


def test_the_core_drops_a_colliding_tag_and_acks_it_silently() -> None:
    wanted, collider = colliding_tags()
    consumer = core(tags=[wanted])
    assert consumer.pull_request("rt1")["tags"] == [wanted]
    batch = [
        Message("a", "orders", tags=(wanted,), body=b"yes"),
        Message("b", "orders", tags=(collider,), body=b"no"),
        Message("c", "orders", tags=(collider, wanted), body=b"yes too"),
    ]
    received = consumer.accept_pull("rt1", *answer(0, batch), T0)
    assert [m.id for m in received] == ["a", "c"]
    tracker = consumer.links["rt1"].tracker
    assert tracker.to_ack.ranges() == [(1, 2)]
    stats = consumer.statistics()
    assert (stats.filtered, stats.received, stats.held_messages) == (1, 2, 2)


def test_bad_tags_are_refused_naming_the_field() -> None:
    with pytest.raises(LocalProtocolError) as caught:
        TagFilter(["t1", "t2", "t3"], Limits(max_tags=2))
    assert (caught.value.field, caught.value.limit) == ("tags", 2)
    with pytest.raises(LocalProtocolError) as caught:
        TagFilter(["x" * 65])
    assert (caught.value.field, caught.value.limit) == ("tag", 64)
    with pytest.raises(LocalProtocolError, match="not a sequence"):
        TagFilter("paid")


# ------------------------------------------------------------------- flow


def test_flow_control_room_and_caps() -> None:
    flow = FlowControl(10, 100)
    assert flow.room() == (10, 100)
    flow.take(4, 60)
    assert flow.room() == (6, 40)
    flow.take(1, 40)
    assert flow.room() is None  # bytes cap reached
    flow.release(1, 40)
    flow.take(6, 0)
    assert flow.room() is None  # messages cap reached
    with pytest.raises(LocalProtocolError) as caught:
        FlowControl(0, 100)
    assert caught.value.field == "max_messages_held"


def test_pulls_ask_for_the_room_left_and_stop_at_the_caps() -> None:
    consumer = core(max_messages_held=5, max_bytes_held=1000, pull_batch=3)
    request = consumer.pull_request("rt1")
    assert request is not None and request["max"] == 3 and request["max_bytes"] == 1000
    held = consumer.accept_pull("rt1", *answer(0, msgs(3, body=b"b" * 100)), T0)
    request = consumer.pull_request("rt1")
    assert request is not None and request["max"] == 2 and request["max_bytes"] == 700
    held += consumer.accept_pull("rt1", *answer(3, msgs(2, body=b"b" * 100, prefix="n")), T0)
    assert consumer.pull_request("rt1") is None
    assert consumer.settle(held[0], True)
    assert not consumer.settle(held[0], True)  # twice: counted once
    request = consumer.pull_request("rt1")
    assert request is not None and request["max"] == 1
    stats = consumer.statistics()
    assert (stats.held_messages, stats.held_bytes, stats.acked) == (4, 400, 1)


def test_closing_nacks_everything_held() -> None:
    consumer = core()
    held = consumer.accept_pull("rt1", *answer(0, msgs(4)), T0)
    consumer.settle(held[1], True)
    assert consumer.release_all() == 3
    (settlement,) = consumer.take_pending()
    assert settlement.acks == [(1, 2)]
    assert settlement.nacks == [(0, 1), (2, 4)]
    assert consumer.statistics().held_messages == 0


# ------------------------------------------------------------ the core


def test_received_messages_carry_everything_and_settle_through_the_consumer() -> None:
    settled: list[tuple[str, bool]] = []
    consumer = core()
    message = Message(
        "m1", "orders", tags=("a",), properties={"k": "v"}, body=b"hi", deliver_at=T0, created_at=T0 - 5, attempts=2
    )
    (received,) = consumer.accept_pull(
        "rt1", *answer(7, [message], acked=7), T0 + 40, lambda m, ack: settled.append((m.id, ack))
    )
    assert isinstance(received, ReceivedMessage)
    assert (received.id, received.subject, received.tags, received.properties, received.body) == (
        "m1", "orders", ("a",), {"k": "v"}, b"hi",
    )  # fmt: skip
    times = (received.deliver_at, received.created_at, received.attempts, received.received_at)
    assert times == (T0, T0 - 5, 2, T0 + 40)
    assert (received.server_group, received.sequence, received.lateness_ms) == ("rt1", 7, 40)
    received.nack()
    assert settled == [("m1", False)]


def test_an_answer_that_does_not_add_up_is_a_remote_error() -> None:
    consumer = core()
    metadata, body = answer(0, msgs(2))
    metadata["count"] = 3
    with pytest.raises(RemoteProtocolError) as caught:
        consumer.accept_pull("rt1", metadata, body, T0)
    assert caught.value.field == "count"
    with pytest.raises(RemoteProtocolError):
        consumer.accept_pull("rt1", {"count": 0, "acked": 0}, b"", T0)


def test_route_changes_start_and_stop_groups() -> None:
    consumer = core()
    assert consumer.update_route([("rt1", "127.0.0.1:1"), ("rt2", "127.0.0.1:2")]) == (["rt2"], [])
    assert consumer.update_route([("rt2", "127.0.0.1:3")]) == ([], ["rt1"])
    assert consumer.links["rt2"].address == "127.0.0.1:3"
    assert consumer.statistics().server_groups == ("rt2",)
    assert consumer.update_route([("rt1", "127.0.0.1:1"), ("rt2", "127.0.0.1:3")]) == (["rt1"], [])


#: The ceilings of the waits after 1, 2, ... failed pulls in a row: the policy's first wait,
#: doubling up to its cap (which bounds how soon a restarted server is pulled again).
PULL_CEILINGS_MS = [PULL_BACKOFF.ceiling_ms(n) for n in range(1, 8)]


def test_consumers_that_lost_a_group_together_pull_it_again_spread_out_never_in_a_tight_loop() -> None:
    rng = random.Random(5)
    consumers = [core(random=rng.random) for _ in range(40)]
    assert PULL_CEILINGS_MS[0] < PULL_CEILINGS_MS[-1] == PULL_BACKOFF.maximum_ms  # it grows, up to its cap
    waits = [[consumer.pull_failed("rt1") for _ in PULL_CEILINGS_MS] for consumer in consumers]
    for n, ceiling in enumerate(PULL_CEILINGS_MS):
        nth = [each[n] for each in waits]
        assert all(ceiling // 2 <= wait <= ceiling for wait in nth), (n, nth)  # the floor, the cap
        assert len(set(nth)) > 20, (n, nth)  # not in lockstep
    assert consumers[0].statistics().pull_failures == len(PULL_CEILINGS_MS)


def test_failed_pulls_wait_at_least_half_the_ceiling_per_subject_and_start_over_on_an_answer() -> None:
    floor = core(random=lambda: 0.0)
    assert [floor.pull_failed("rt1") for _ in PULL_CEILINGS_MS] == [c // 2 for c in PULL_CEILINGS_MS]
    first = PULL_CEILINGS_MS[0] // 2
    assert floor.pull_failed("rt1", retry=True) == first  # the retry subject's pulls back off on their own
    floor.accept_pull("rt1", *answer(0, []), T0)
    assert floor.pull_failed("rt1") == first  # an answer starts the backoff over
    top = core(random=lambda: 1 - 1e-9)
    assert [top.pull_failed("rt1") for _ in PULL_CEILINGS_MS] == [c - 1 for c in PULL_CEILINGS_MS]


def test_pull_requests_say_what_the_consumer_is() -> None:
    consumer = core(broadcast=True, start="earliest", tags=["a", "b", "a"], poll_timeout_ms=2500)
    assert consumer.pull_request("rt1") == {
        "group": "billing",
        "consumer": "c1",
        "subject": "orders",
        "max": 100,
        "max_bytes": 64 * 1024 * 1024 - 64 * 1024,  # a frame's worth, not more
        "timeout_ms": 2500,
        "tags": ["a", "b"],
        "broadcast": True,
        "from": "earliest",
    }
    assert "from" not in core().pull_request("rt1")  # type: ignore[operator]
    assert consumer.heartbeat_metadata() == {"group": "billing", "consumer": "c1", "subjects": ["orders"]}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"subject": "s" * 256}, "subject"),
        ({"group": ""}, "group"),
        ({"consumer_id": "bad\nname"}, "consumer_id"),
        ({"start": "middle"}, "start"),
        ({"pull_batch": 0}, "pull_batch"),
        ({"pull_batch": 10_001}, "pull_batch"),
        ({"poll_timeout_ms": 300_001}, "poll_timeout_ms"),
        ({"max_bytes_held": 0}, "max_bytes_held"),
        ({"broadcast": "yes"}, "broadcast"),
    ],
)
def test_consumer_options_are_checked_naming_the_field(options: dict[str, Any], field: str) -> None:
    settings: dict[str, Any] = {"subject": "orders", "group": "billing"}
    settings.update(options)
    subject = settings.pop("subject")
    with pytest.raises(LocalProtocolError) as caught:
        ConsumerCore(subject, **settings)
    assert caught.value.field == field
