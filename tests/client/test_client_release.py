"""The consumer's release queue: messages fetched ahead wait until due, in order within their lane."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.client.delivery import ReceivedMessage, fetch_ahead_ms
from delaymq.client.release import ReleaseQueue
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.limits import MAX_PULL_AHEAD_MS

T0 = 1_767_225_600_000


def received(
    id: str, *, deliver_at: int, created_at: int = T0 - 60_000, at: int = T0, group: str = "rt1", retry: bool = False
) -> ReceivedMessage:
    """A message that reached the consumer at ``at`` from ``group`` (its retry subject with ``retry``)."""
    pulled = "%retry%g%orders" if retry else ""
    return ReceivedMessage(id, "orders", (), {}, b"", deliver_at, created_at, 0, at, group, 0, pulled_subject=pulled)


def ids(messages: list[ReceivedMessage]) -> list[str]:
    return [m.id for m in messages]


def test_a_message_fetched_ahead_is_released_at_its_deliver_at_and_stamped_then() -> None:
    queue = ReleaseQueue(ahead_ms=200)
    queue.add([received("later", deliver_at=T0 + 150)], T0)
    assert queue.take(T0) == [] and queue.take(T0 + 149) == [] and len(queue) == 1
    assert queue.next_release() == T0 + 150
    (message,) = queue.take(T0 + 152)
    assert message.id == "later" and message.received_at == T0 + 152 and message.lateness_ms == 2
    assert len(queue) == 0 and queue.next_release() is None


def test_what_is_behind_a_held_message_in_its_lane_waits_and_other_lanes_pass() -> None:
    queue = ReleaseQueue(ahead_ms=200)
    queue.add([received("held", deliver_at=T0 + 100), received("now", deliver_at=T0, created_at=T0)], T0)
    queue.add([received("retry-now", deliver_at=T0 - 5, retry=True)], T0)  # another lane: due already
    queue.add([received("other-group", deliver_at=T0, created_at=T0, group="rt2")], T0)
    assert ids(queue.take(T0)) == ["retry-now", "other-group"]
    assert ids(queue.take(T0 + 100)) == ["held", "now"]  # the subject's order, from one group


def test_an_immediate_message_is_never_held_however_far_ahead_its_producers_clock_is() -> None:
    queue = ReleaseQueue(ahead_ms=200)
    skewed = received("skewed", deliver_at=T0 + 120_000, created_at=T0 + 120_000)
    queue.add([skewed], T0)
    (message,) = queue.take(T0)
    assert message is skewed and message.received_at == T0  # as it arrived


def test_a_consumer_clock_behind_the_servers_holds_no_longer_than_fetch_ahead() -> None:
    """The server hands out at most ``ahead_ms`` before due by its clock; a consumer whose clock
    is a minute behind releases at arrival + ``ahead_ms`` (early by its own clock), not a minute later."""
    queue = ReleaseQueue(ahead_ms=200)
    queue.add([received("m", deliver_at=T0 + 60_100, at=T0)], T0)
    assert queue.take(T0 + 199) == []
    (message,) = queue.take(T0 + 200)
    assert message.received_at == T0 + 200 and message.lateness_ms < 0


def test_take_hands_out_at_most_max_messages_in_order() -> None:
    queue = ReleaseQueue(ahead_ms=0)
    queue.add([received(f"m{n}", deliver_at=T0 - 1) for n in range(5)], T0)
    assert ids(queue.take(T0, 2)) == ["m0", "m1"] and len(queue) == 3
    assert ids(queue.take(T0)) == ["m2", "m3", "m4"] and len(queue) == 0


lanes = st.sampled_from([("rt1", False), ("rt1", True), ("rt2", False)])
arrivals = st.lists(
    st.tuples(
        lanes,
        st.integers(0, 500),  # arrival, ms after T0
        st.integers(-300, 800),  # deliver_at - arrival
        st.booleans(),  # scheduled (deliver_at after created_at)?
        st.integers(0, 300),  # how long it waited before the queue took it (a busy consumer)
    ),
    max_size=40,
)


@given(arrivals, st.lists(st.integers(0, 1_500), max_size=20), st.integers(0, MAX_PULL_AHEAD_MS))
def test_nothing_is_released_before_its_moment_or_out_of_its_lanes_order_and_all_of_it_in_the_end(
    items: list[tuple[tuple[str, bool], int, int, bool, int]], takes: list[int], ahead: int
) -> None:
    queue = ReleaseQueue(ahead_ms=ahead)
    sent: dict[tuple[str, bool], list[str]] = {}
    moment: dict[str, int] = {}
    added = [(at + wait, 0, n) for n, (_lane, at, _d, _s, wait) in enumerate(items)]
    events = sorted(added + [(t, 1, -1) for t in takes])
    out: list[ReceivedMessage] = []
    for now, kind, n in events:
        if kind == 0:
            (group, retry), at, offset, scheduled, _wait = items[n]
            deliver_at = T0 + at + offset
            created = deliver_at - 1 if scheduled else deliver_at
            message = received(f"m{n}", deliver_at=deliver_at, created_at=created, at=T0 + at, group=group, retry=retry)
            sent.setdefault((group, retry), []).append(message.id)
            # Never before deliver_at, nor later than fetch_ahead after arrival; at once if not scheduled.
            moment[message.id] = max(T0 + at, min(deliver_at, T0 + at + ahead)) if scheduled else T0 + at
            queue.add([message], T0 + now)
        else:
            out += queue.take(T0 + now)
    out += queue.take(T0 + 10_000)
    assert len(queue) == 0 and sorted(ids(out)) == sorted(f"m{n}" for n in range(len(items)))
    for message in out:
        assert message.received_at >= moment[message.id]
        if message.deliver_at > message.created_at and moment[message.id] >= message.deliver_at:
            assert message.lateness_ms >= 0  # never early by this clock once its clock allows
    for (group, retry), expected in sent.items():
        lane = [m.id for m in out if m.server_group == group and bool(m.pulled_subject) == retry]
        assert lane == expected


@pytest.mark.parametrize("seconds", [-0.001, 1.001, 5, float("nan"), "0.2", None])
def test_fetch_ahead_beyond_zero_to_one_second_is_refused_naming_it(seconds: Any) -> None:
    with pytest.raises(LocalProtocolError) as refused:
        fetch_ahead_ms(seconds)
    assert refused.value.field == "fetch_ahead"


def test_fetch_ahead_is_rounded_up_to_the_millisecond() -> None:
    assert [fetch_ahead_ms(s) for s in (0, 0.2, 0.0001, 1)] == [0, 200, 1, 1_000]
