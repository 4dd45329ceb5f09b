"""The field checks both ends share: names, bounded integers, batch request bodies, listen addresses."""

from __future__ import annotations

from typing import Any

import pytest

from delaymq.net.addresses import parse_address, split_listen
from delaymq.net.requests import Request
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from delaymq.protocol.fields import check_int, check_name, encode_name
from delaymq.protocol.frames import request


@pytest.mark.parametrize(
    ("value", "code", "limit", "message"),
    [
        (7, "bad_value", None, "group is of type int, not str"),
        ("", "limit", 5, "group is 0 UTF-8 bytes, must be 1 to 5"),
        ("ééé", "limit", 5, "group is 6 UTF-8 bytes, must be 1 to 5"),
        ("a\nb", "bad_value", None, "group 'a\\nb' holds a control character"),
        ("a\ud800", "bad_value", None, "group 'a\\ud800' is not valid Unicode text"),
    ],
)
def test_a_bad_name_is_refused_naming_field_and_limit(value: Any, code: str, limit: int | None, message: str) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        check_name(value, "group", 5)
    assert (caught.value.code, caught.value.field, caught.value.limit, str(caught.value)) == (
        code,
        "group",
        limit,
        message,
    )


def test_a_server_refuses_a_name_as_the_peers_fault_with_its_command() -> None:
    with pytest.raises(RemoteProtocolError, match=r"^PULL: consumer is 6 UTF-8 bytes, must be 1 to 5$"):
        check_name("abcdef", "consumer", 5, error=RemoteProtocolError, command="PULL")


def test_a_good_name_passes_and_encodes_as_utf8() -> None:
    assert check_name("día", "subject", 4) == "día"
    assert encode_name("día", "subject", 4) == "día".encode()


@pytest.mark.parametrize(
    ("value", "code", "limit"),
    [(True, "bad_value", None), (1.0, "bad_value", None), (0, "limit", 1), (11, "limit", 10)],
)
def test_check_int_refuses_non_ints_and_names_the_bound_broken(value: Any, code: str, limit: int | None) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_int(value, "pull_batch", 1, 10)
    assert (caught.value.code, caught.value.field, caught.value.limit) == (code, "pull_batch", limit)
    assert check_int(10, "pull_batch", 1, 10) == 10


def _request(metadata: dict[str, Any], body: bytes) -> Request:
    return Request(request(Command.SCHEDULE, 1, metadata, body), "peer")


def test_a_batch_request_takes_no_metadata_and_needs_records() -> None:
    assert _request({}, b"records").batch_body() == b"records"
    with pytest.raises(
        RemoteProtocolError, match=r"^SCHEDULE: unknown field 'x' \(SCHEDULE takes no metadata"
    ) as caught:
        _request({"x": 1}, b"records").batch_body()
    assert (caught.value.code, caught.value.field) == ("bad_request", "x")
    with pytest.raises(RemoteProtocolError, match=r"^SCHEDULE: the body holds no records$"):
        _request({}, b"").batch_body()


def test_listen_addresses_may_ask_for_port_zero_peer_addresses_may_not() -> None:
    assert split_listen("[::1]:0") == ("::1", 0)
    assert parse_address("host:80") == ("host", 80)
    with pytest.raises(ValueError, match=r"^address 'host:0' is not HOST:PORT with a port from 1 to 65535$"):
        parse_address("host:0")
    for bad in ("host", ":80", "host:65536", "host:x"):
        with pytest.raises(ValueError, match="listen address"):
            split_listen(bad)
