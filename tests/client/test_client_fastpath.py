"""The producer's fast path: ``build_message`` of a subject, a bytes body and a delay alone.

It must be invisible: for any input, the message, its record and any refusal are those of
the general path (reached here by giving ``tags`` as a list, which the fast path leaves alone).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from datetime import timedelta
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.client import messages
from delaymq.client.messages import SentId, build_message, plan_frames
from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol import records
from delaymq.protocol.errors import LocalProtocolError
from delaymq.protocol.records import Message, decode_batch, encode_message

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
I64_MAX = (1 << 63) - 1

subjects = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=10),
    st.text(max_size=14),
    st.text(st.characters(max_codepoint=0xA0), max_size=6),  # control characters
    st.sampled_from(["orders", "\ud800", "é" * 7, "a\x00b", "a\x85"]),  # a surrogate, 2-byte UTF-8
    st.integers(),  # not a str
    st.binary(max_size=4),
)
delays = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-2.0, max_value=20_000.0),
    st.integers(min_value=-5, max_value=20_000),
    st.booleans(),  # not a number of seconds
    st.timedeltas(min_value=timedelta(seconds=-2), max_value=timedelta(hours=6)),
    st.just("5"),
)
limits = st.one_of(
    st.just(DEFAULT_LIMITS),
    st.builds(
        Limits,
        max_subject=st.integers(1, 12),
        max_body=st.integers(1, 48),
        max_id=st.sampled_from([64, 32, 31, 8]),  # below 32 a made id is too long
        horizon_ms=st.integers(1, 10**7),
    ),
)
nows = st.one_of(st.integers(0, 1 << 45), st.integers(I64_MAX - 10**7, I64_MAX))  # near the end of an i64


def outcome(make: Any) -> tuple[str, Any]:
    """What ``make()`` gives: the message, or what its refusal says."""
    try:
        return "message", make()
    except LocalProtocolError as error:
        return "refused", (error.code, error.field, error.limit, error.index, str(error))


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(subjects, st.binary(max_size=64), delays, limits, nows, st.booleans())
def test_the_fast_path_builds_and_refuses_as_the_general_path(
    subject: Any, body: bytes, delay: Any, limits: Limits, now: int, check: bool
) -> None:
    kind, fast = outcome(lambda: build_message(subject, body, delay=delay, now_ms=now, limits=limits, check=check))
    if kind == "refused":
        general = outcome(
            lambda: build_message(subject, body, tags=[], delay=delay, now_ms=now, limits=limits, check=check)
        )
        assert general == (kind, fast)
        return
    assert type(fast) is Message
    general = build_message(subject, body, tags=[], id=fast.id, delay=delay, now_ms=now, limits=limits, check=check)
    assert fast == general and fast.properties == {} and fast.created_at == now
    # Unchecked (check=False, a field out of its limit): plan_frames refuses both the same way.
    encoded = outcome(lambda: plan_frames([fast], now_ms=now, limits=limits).frames[0].body)
    assert encoded == outcome(lambda: plan_frames([general], now_ms=now, limits=limits).frames[0].body)
    if encoded[0] == "message":
        record = encode_message(fast.id, subject, body=body, deliver_at=fast.deliver_at, created_at=now, limits=limits)
        assert fast.encode(limits) == general.encode(limits) == record == encoded[1]
        assert decode_batch(record) == [fast]


valid_subjects = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=40).filter(
    lambda subject: len(subject.encode()) <= DEFAULT_LIMITS.max_subject
)


@settings(max_examples=300)
@given(
    valid_subjects,
    st.binary(max_size=2000),
    st.one_of(st.none(), st.floats(min_value=0, max_value=700 * 86_400), st.integers(0, 700 * 86_400)),
    st.integers(1, 1 << 45),  # (a created_at of 0 means "not set": plan_frames sets it)
    st.booleans(),
)
def test_a_fast_message_is_the_message_asked_for_encoded_once(
    subject: str, body: bytes, delay: float | int | None, now: int, check: bool
) -> None:
    with (
        patch.object(messages, "make_plain_message", wraps=messages.make_plain_message) as make,
        patch.object(records, "encode_message", wraps=records.encode_message) as encode,
    ):
        message = build_message(subject, body, delay=delay, now_ms=now, check=check)
        # Encoded once, by the fast path, even with check=False (the general path then encodes in plan_frames).
        assert (make.call_count, encode.call_count) == (1, 0)
        deliver_at = now if delay is None else now + math.ceil(delay * 1000)
        assert message == Message(message.id, subject, body=body, deliver_at=deliver_at, created_at=now)
        record = message.encode()
        assert plan_frames([message], now_ms=now).frames[0].body == record
        assert (make.call_count, encode.call_count) == (1, 0)
    assert record == encode_message(message.id, subject, body=body, deliver_at=deliver_at, created_at=now)
    assert len(message.id) == 32


def test_a_subject_kept_encoded_is_still_checked_against_each_producers_limits() -> None:
    """The fast path keeps each subject's bytes; a producer with a lower subject limit is still refused."""
    assert build_message("reminders", b"b", delay=5.0, now_ms=T0).subject == "reminders"
    with pytest.raises(LocalProtocolError) as refused:
        build_message("reminders", b"b", delay=5.0, now_ms=T0, limits=Limits(max_subject=8))
    assert (refused.value.field, refused.value.limit) == ("subject", 8)


def test_the_kept_subjects_start_over_when_full_and_every_message_stays_right() -> None:
    subjects = [f"subject-{n}" for n in range(messages.SUBJECTS_KEPT + 10)]
    built = [build_message(subject, b"b", delay=1.0, now_ms=T0) for subject in subjects]
    assert len(messages._SUBJECT_BYTES) <= messages.SUBJECTS_KEPT
    assert [message.subject for message in decode_batch(b"".join(m.encode() for m in built))] == subjects


def test_each_fast_message_has_properties_of_its_own() -> None:
    """No shared empty mapping: a caller may add properties, and the record then carries them."""
    first = build_message("orders", b"body", delay=60, now_ms=T0)
    second = build_message("orders", b"body", delay=60, now_ms=T0)
    first.properties["note"] = "added"
    assert second.properties == {}
    [sent] = decode_batch(first.encode())
    assert sent.properties == {"note": "added"} and decode_batch(second.encode())[0].properties == {}


def test_a_fast_message_is_checked_again_against_other_limits() -> None:
    message = build_message("orders", b"x" * 100, delay=60, now_ms=T0)
    with pytest.raises(LocalProtocolError) as refused:
        message.encode(Limits(max_body=99))
    assert (refused.value.field, refused.value.limit) == ("body", 99)
    assert message.encode(Limits()) == message.encode()  # equal limits, another object: encoded again, same bytes


def test_a_fast_message_is_frozen_and_copies_replaces_and_pickles() -> None:
    message = build_message("orders", b"body", delay=1.5, now_ms=T0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.body = b"other"  # type: ignore[misc]
    assert copy.copy(message) == copy.deepcopy(message) == pickle.loads(pickle.dumps(message)) == message
    moved = dataclasses.replace(message, deliver_at=T0 + 5_000)
    assert decode_batch(moved.encode())[0].deliver_at == T0 + 5_000


def test_an_id_made_too_long_for_the_limits_is_refused_naming_the_id() -> None:
    with pytest.raises(LocalProtocolError) as refused:
        build_message("orders", b"body", delay=1.0, now_ms=T0, limits=Limits(max_id=16))
    assert (refused.value.field, refused.value.limit) == ("id", 16)


@given(st.lists(st.tuples(st.text(max_size=8), st.one_of(st.none(), st.text(min_size=1, max_size=8))), max_size=20))
def test_sent_ids_made_in_bulk_are_those_made_one_by_one(pairs: list[tuple[str, str | None]]) -> None:
    ids = [message_id for message_id, _ in pairs]
    groups = [group for _, group in pairs]
    many = SentId.many(ids, groups)
    one_by_one = [SentId(message_id, group) for message_id, group in pairs]
    assert many == one_by_one == ids
    assert all(type(sent) is SentId for sent in many)
    assert [sent.group for sent in many] == groups
    assert [(sent.group, str(sent)) for sent in pickle.loads(pickle.dumps(many))] == list(zip(groups, ids, strict=True))


def test_sent_ids_made_in_bulk_are_read_only_and_need_a_group_each() -> None:
    [sent] = SentId.many(["a"], ["g"])
    with pytest.raises(AttributeError):
        sent.group = "other"  # type: ignore[misc]
    with pytest.raises(ValueError):
        SentId.many(["a", "b"], ["g"])
