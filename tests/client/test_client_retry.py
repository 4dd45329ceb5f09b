"""Consumer retries, sans-IO: the retry policy, subject names, and what a nack sends."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from delaymq.client.delivery import ConsumerCore, ReceivedMessage
from delaymq.client.retry import DEFAULT_RETRY_DELAYS, RetryNack, RetryPolicy
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.records import Message, encode_batch
from delaymq.protocol.subjects import dead_subject, original_subject, retry_subject

T0 = 1_767_225_600_000
MINUTE = 60_000
HOUR = 60 * MINUTE


def answer(start: int, messages: list[Message], acked: int = 0) -> tuple[dict[str, Any], bytes]:
    return {"pull_start": start, "count": len(messages), "acked": acked}, encode_batch(messages)


def core(**options: Any) -> ConsumerCore:
    settings: dict[str, Any] = {"group": "billing", "consumer_id": "c1"}
    settings.update(options)
    consumer = ConsumerCore("orders", **settings)
    consumer.update_route([("rt1", "127.0.0.1:1")])
    return consumer


def sent(consumer: ConsumerCore) -> list[tuple[str, dict[str, Any]]]:
    """The ACK / NACK requests the next settle round sends: (command, metadata)."""
    return [
        ("ACK" if request.ack else "NACK", consumer.settle_metadata(settlement, request))
        for settlement in consumer.take_pending()
        for request in settlement.requests()
    ]


# ------------------------------------------------------------------ the policy


def test_the_default_schedule_grows_then_repeats_two_hours_for_sixteen_attempts() -> None:
    policy = RetryPolicy()
    delays = [policy.delay_for(attempts) for attempts in range(15)]
    assert delays == [
        5_000, 10_000, 30_000, MINUTE, 2 * MINUTE, 5 * MINUTE, 10 * MINUTE, 30 * MINUTE, HOUR,
        2 * HOUR, 2 * HOUR, 2 * HOUR, 2 * HOUR, 2 * HOUR, 2 * HOUR,
    ]  # fmt: skip
    assert policy.max_attempts == 16
    # The 16th delivery carries attempts 15: its nack is the last one.
    assert [policy.is_last(attempts) for attempts in (0, 14, 15, 40)] == [False, False, True, True]
    assert policy.nack_for(0) == RetryNack(5_000, False)
    assert policy.nack_for(15) == RetryNack(0, True)
    assert RetryPolicy.from_options(DEFAULT_RETRY_DELAYS, 16) == policy


def test_policy_options_take_seconds_and_timedeltas_rounded_up_to_the_millisecond() -> None:
    policy = RetryPolicy.from_options([0.0014, 2, timedelta(minutes=3)], max_attempts=4)
    assert policy.retry_delays_ms == (2, 2_000, 180_000)
    assert [policy.delay_for(attempts) for attempts in range(5)] == [2, 2_000, 180_000, 180_000, 180_000]
    assert [policy.nack_for(attempts).dead for attempts in range(5)] == [False, False, False, True, True]
    assert RetryPolicy.from_options([1], max_attempts=1).nack_for(0) == RetryNack(0, True)


@pytest.mark.parametrize(
    ("delays", "max_attempts", "field", "limit"),
    [
        ([], 16, "retry_delays", 1),
        ([-1], 16, "retry_delays", 0),
        ([3 * 366 * 86_400], 16, "retry_delays", 2 * 366 * 86_400_000),
        ([float("nan")], 16, "retry_delays", None),
        (["5s"], 16, "retry_delays", None),
        ("5", 16, "retry_delays", None),
        ([5], 0, "max_attempts", 1),
        ([5], 70_000, "max_attempts", 0xFFFF),
        ([5], 2.5, "max_attempts", None),
    ],
)
def test_bad_policies_are_refused_naming_the_field_and_limit(
    delays: Any, max_attempts: Any, field: str, limit: int | None
) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        RetryPolicy.from_options(delays, max_attempts)
    assert (caught.value.field, caught.value.limit) == (field, limit)
    with pytest.raises(LocalProtocolError) as caught:
        core(retry_delays=delays, max_attempts=max_attempts)
    assert caught.value.field == field


def test_retry_and_dead_subjects_name_group_and_original_subject() -> None:
    assert retry_subject("billing", "orders") == "%retry%billing%orders"
    assert retry_subject("billing", "%retry%billing%orders") == "%retry%billing%orders"  # not nested
    assert original_subject("billing", "%retry%billing%orders") == "orders"
    assert original_subject("audit", "%retry%billing%orders") == "%retry%billing%orders"
    assert dead_subject("billing", "orders") == "%dead%billing%orders"
    assert dead_subject("billing", "%retry%billing%orders") == "%dead%billing%orders"


# ------------------------------------------------------------------ the consumer


def test_group_names_with_percent_and_too_long_retry_subjects_are_refused() -> None:
    with pytest.raises(LocalProtocolError) as caught:
        core(group="bill%ing")
    assert caught.value.field == "group" and "%" in str(caught.value)
    with pytest.raises(LocalProtocolError) as caught:
        ConsumerCore("s" * 241, group="billing")  # "%retry%billing%" + 241 bytes: 256
    assert (caught.value.field, caught.value.limit) == ("subject", 255)
    assert ConsumerCore("s" * 240, group="billing").retry_subject == "%retry%billing%" + "s" * 240
    # A dead-letter subject is consumed like any other (its own retries included).
    dead = ConsumerCore("%dead%billing%orders", group="ops")
    assert dead.retry_subject == "%retry%ops%%dead%billing%orders"


def test_a_clustered_consumer_pulls_the_retry_subject_from_its_start() -> None:
    consumer = core(poll_timeout_ms=1000)
    assert consumer.lanes == (False, True)
    main, retry = consumer.pull_request("rt1"), consumer.pull_request("rt1", retry=True)
    assert main is not None and retry is not None
    assert (main["subject"], "from" in main) == ("orders", False)
    assert (retry["subject"], retry["from"]) == ("%retry%billing%orders", "earliest")
    assert consumer.heartbeat_metadata()["subjects"] == ["orders", "%retry%billing%orders"]
    broadcast = core(broadcast=True)
    assert broadcast.lanes == (False,) and broadcast.retry_subject is None


def test_a_retried_message_shows_its_original_subject_and_id() -> None:
    consumer = core()
    back = Message("m1", "%retry%billing%orders", tags=("t",), body=b"b", deliver_at=T0, created_at=T0 - 9, attempts=3)
    (received,) = consumer.accept_pull("rt1", *answer(0, [back]), T0 + 5, retry=True)
    assert isinstance(received, ReceivedMessage)
    assert (received.id, received.subject, received.attempts, received.tags) == ("m1", "orders", 3, ("t",))
    assert received.pulled_subject == "%retry%billing%orders"
    assert consumer.statistics().received_retries == 1


def test_nacks_ask_for_the_delay_of_each_message_and_the_last_one_for_the_dead_letters() -> None:
    consumer = core(retry_delays=(5, 10, 30), max_attempts=4)
    batch = [Message(f"m{n}", "orders", body=b"x", attempts=attempts) for n, attempts in enumerate([0, 0, 1, 3, 0, 2])]
    held = consumer.accept_pull("rt1", *answer(0, batch), T0)
    for message in held[:-1]:
        consumer.settle(message, False)
    consumer.settle(held[-1], True)
    requests = sent(consumer)
    base = {"group": "billing", "consumer": "c1", "subject": "orders"}
    # One NACK per delay asked for (adjacent ranges of one delay merge), then the ACK.
    assert requests == [
        ("NACK", {**base, "start": 0, "end": 2, "delay_ms": 5_000, "dead": False}),
        ("NACK", {**base, "start": 4, "end": 5, "delay_ms": 5_000, "dead": False}),
        ("NACK", {**base, "start": 2, "end": 3, "delay_ms": 10_000, "dead": False}),
        ("NACK", {**base, "start": 3, "end": 4, "delay_ms": 0, "dead": True}),
        ("ACK", {**base, "start": 5, "end": 6}),
    ]
    stats = consumer.statistics()
    assert (stats.nacked, stats.retried, stats.dead, stats.acked) == (5, 4, 1, 1)


def test_settling_a_retried_message_goes_to_the_retry_subject_it_came_from() -> None:
    consumer = core(retry_delays=(5,), max_attempts=3)
    first = consumer.accept_pull("rt1", *answer(0, [Message("new", "orders")]), T0)
    back = consumer.accept_pull(
        "rt1", *answer(0, [Message("a", "%retry%billing%orders", attempts=1),
                           Message("b", "%retry%billing%orders", attempts=2)]), T0, retry=True,
    )  # fmt: skip
    # The same pull-log sequence 0 on each subject: settled apart.
    consumer.settle(first[0], True)
    consumer.settle(back[0], False)
    consumer.settle(back[1], False)
    retry_base = {"group": "billing", "consumer": "c1", "subject": "%retry%billing%orders"}
    assert sorted(sent(consumer), key=lambda r: (r[1]["subject"], r[1]["start"])) == [
        ("NACK", {**retry_base, "start": 0, "end": 1, "delay_ms": 5_000, "dead": False}),
        ("NACK", {**retry_base, "start": 1, "end": 2, "delay_ms": 0, "dead": True}),
        ("ACK", {"group": "billing", "consumer": "c1", "subject": "orders", "start": 0, "end": 1}),
    ]


def test_closing_gaps_and_broadcast_nacks_give_back_at_once() -> None:
    consumer = core()
    held = consumer.accept_pull("rt1", *answer(3, [Message("a", "orders"), Message("b", "orders")], acked=0), T0)
    consumer.settle(held[0], False)
    assert consumer.release_all() == 1
    requests = sent(consumer)
    assert [(command, m["start"], m["end"], "delay_ms" in m) for command, m in requests] == [
        ("NACK", 0, 3, False),  # the gap this process never saw
        ("NACK", 4, 5, False),  # released when closing
        ("NACK", 3, 4, True),  # nacked by the application
    ]
    broadcast = core(broadcast=True)
    (message,) = broadcast.accept_pull("rt1", *answer(0, [Message("a", "orders")]), T0)
    broadcast.settle(message, False)
    assert [m for _, m in sent(broadcast)] == [
        {"group": "billing", "consumer": "c1", "subject": "orders", "start": 0, "end": 1}
    ]


def test_a_failed_round_puts_retry_nacks_back_with_their_delay() -> None:
    consumer = core(retry_delays=(7,))
    held = consumer.accept_pull("rt1", *answer(0, [Message("a", "orders"), Message("b", "orders")]), T0)
    consumer.settle(held[0], False)
    consumer.settle(held[1], True)
    (settlement,) = consumer.take_pending()
    requests = settlement.requests()
    assert not consumer.has_pending()
    consumer.settle_failed(settlement, requests)
    assert consumer.has_pending()
    assert [(c, m["start"], m.get("delay_ms")) for c, m in sent(consumer)] == [("NACK", 0, 7_000), ("ACK", 1, None)]
    assert consumer.statistics().settle_failures == 1
