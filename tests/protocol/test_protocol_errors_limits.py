"""Errors travel as dicts and name what broke; limits have sane defaults and caps."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from delaymq.net.limits import DEFAULT_LIMITS, Limits
from delaymq.protocol import LocalProtocolError, PeerError, ProtocolError, RemoteProtocolError


def test_default_limits_are_the_documented_ones() -> None:
    limits = Limits()
    assert limits == DEFAULT_LIMITS
    assert limits.max_frame == 64 * 1024 * 1024
    assert limits.max_body == 4 * 1024 * 1024
    assert (limits.max_subject, limits.max_id, limits.max_tags, limits.max_tag) == (255, 64, 16, 64)
    assert limits.max_properties == 64 * 1024
    assert limits.horizon_ms == 2 * 366 * 24 * 3600 * 1000
    assert limits.max_record > limits.max_body


def test_limits_are_keyword_only_and_frozen() -> None:
    assert Limits(max_subject=10).max_subject == 10
    with pytest.raises(TypeError):
        Limits(10)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        DEFAULT_LIMITS.max_body = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_subject": 0}, "max_subject"),
        ({"max_id": 1 << 16}, "max_id"),  # the id length is a u16
        ({"max_tag": 256}, "max_tag"),  # a tag length is a u8
        ({"max_tags": 256}, "max_tags"),
        ({"max_frame": 1 << 32}, "max_frame"),
        ({"max_body": -1}, "max_body"),
        ({"max_body": 1.5}, "max_body"),
    ],
)
def test_limits_the_layout_cannot_hold_are_refused(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        Limits(**kwargs)


def test_an_error_round_trips_through_a_msgpack_dict() -> None:
    error = RemoteProtocolError(
        "record 2: subject is 300 UTF-8 bytes, must be 1 to 255",
        code="limit",
        field="subject",
        limit=255,
        index=2,
    )
    data = msgpack.unpackb(msgpack.packb(error.to_dict()))
    assert data == {
        "code": "limit",
        "message": "record 2: subject is 300 UTF-8 bytes, must be 1 to 255",
        "field": "subject",
        "limit": 255,
        "index": 2,
    }
    again = PeerError.from_dict(data)
    assert isinstance(again, PeerError) and isinstance(again, ProtocolError)
    assert (again.code, again.field, again.limit, again.index, str(again)) == (
        "limit",
        "subject",
        255,
        2,
        str(error),
    )
    plain = LocalProtocolError.from_dict({"code": "bad_request", "message": "no such command"})
    assert isinstance(plain, LocalProtocolError)
    assert (plain.field, plain.limit, plain.index) == (None, None, None)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], "error"),
        ({}, "error.code"),
        ({"code": 5}, "error.code"),
        ({"code": "x", "message": 5}, "error.message"),
        ({"code": "x", "field": 5}, "error.field"),
        ({"code": "x", "limit": [1]}, "error.limit"),
        ({"code": "x", "limit": True}, "error.limit"),
        ({"code": "x", "index": "3"}, "error.index"),
    ],
)
def test_a_malformed_error_dict_is_refused(data: object, field: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        ProtocolError.from_dict(data)
    assert (info.value.code, info.value.field) == ("bad_metadata", field)


def test_errors_pickle_with_their_attributes() -> None:
    error = RemoteProtocolError("bad", code="bad_magic", field="magic", fatal=True, request_id=3, command=20)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is RemoteProtocolError
    assert (again.code, again.field, again.fatal, again.request_id, again.command) == (
        "bad_magic",
        "magic",
        True,
        3,
        20,
    )
