"""Connection admission, sans-IO: each cap refuses with its name and limit, and lets go on close."""

from __future__ import annotations

import pytest

from delaymq.net.admission import Admitted, ConnectionAdmission, Refusal, RefusalLog, spare_fds_for
from delaymq.net.limits import ConnectionLimits, Limits


def admission(**options: object) -> ConnectionAdmission:
    fd_limit = options.pop("fd_limit", None)
    max_frame = options.pop("max_frame", 1000)
    return ConnectionAdmission(ConnectionLimits(**options), max_frame=max_frame, fd_limit=fd_limit)  # type: ignore[arg-type]


def test_server_cap_refuses_the_connection_past_it_until_one_closes() -> None:
    gate = admission(max_connections=2)
    first = gate.admit("10.0.0.1", 10)
    second = gate.admit("10.0.0.2", 11)
    assert isinstance(first, Admitted) and isinstance(second, Admitted)
    third = gate.admit("10.0.0.3", 12)
    assert isinstance(third, Refusal)
    assert (third.cap, third.limit) == ("connections", 2)
    error = third.error()
    assert (error.code, error.field, error.limit) == ("unavailable", "connections", 2)
    assert "2 connections" in error.message
    gate.close(first)
    assert isinstance(gate.admit("10.0.0.3", 10), Admitted)
    assert (gate.open, gate.admitted, gate.refused["connections"]) == (2, 3, 1)


def test_address_cap_refuses_one_address_not_the_others() -> None:
    gate = admission(max_per_address=2)
    held = [gate.admit("10.0.0.9", fd) for fd in (10, 11)]
    refused = gate.admit("10.0.0.9", 12)
    assert isinstance(refused, Refusal) and refused.cap == "connections_per_address"
    assert "10.0.0.9" in refused.message and refused.limit == 2
    assert isinstance(gate.admit("10.0.0.1", 12), Admitted)
    for connection in held:
        assert isinstance(connection, Admitted)
        gate.close(connection)
    assert "10.0.0.9" not in gate.per_address  # no entry left behind per address ever seen
    assert isinstance(gate.admit("10.0.0.9", 10), Admitted)


@pytest.mark.parametrize(
    ("options", "per_address"),
    [
        ({}, 1000),
        ({"max_connections": 500}, 250),
        ({"fd_limit": 1024}, 448),  # (1024 - 128 spare) / 2
        ({"fd_limit": 1024, "max_per_address": 10}, 10),
        ({"max_connections": 1}, 1),
    ],
)
def test_one_address_may_hold_at_most_half_of_what_the_server_can(options: dict, per_address: int) -> None:
    gate = admission(**options)
    assert gate.max_per_address == per_address
    held = [gate.admit("10.0.0.1", 10) for _ in range(per_address)]
    assert all(isinstance(connection, Admitted) for connection in held)
    refused = gate.admit("10.0.0.1", 10)
    assert isinstance(refused, Refusal) and refused.limit == per_address


def test_in_memory_connections_have_no_address_or_descriptor_to_cap() -> None:
    gate = admission(max_per_address=1, fd_limit=100, spare_fds=10)
    assert all(isinstance(gate.admit(None, None), Admitted) for _ in range(5))


def test_descriptor_ceiling_keeps_spare_descriptors_for_the_server() -> None:
    gate = admission(fd_limit=1024, spare_fds=100)
    assert gate.fd_ceiling == 924
    assert isinstance(gate.admit("10.0.0.1", 923), Admitted)
    refused = gate.admit("10.0.0.1", 924)
    assert isinstance(refused, Refusal)
    assert (refused.cap, refused.limit) == ("file_descriptors", 924)
    assert "limit of 1024" in refused.message and "100 kept" in refused.message


@pytest.mark.parametrize(("fd_limit", "spare"), [(1024, 128), (256, 64), (100, 50), (20_000, 1024), (1_000_000, 1024)])
def test_default_spare_descriptors_scale_with_the_open_file_limit(fd_limit: int, spare: int) -> None:
    assert spare_fds_for(fd_limit) == spare
    assert admission(fd_limit=fd_limit).fd_ceiling == fd_limit - spare


def test_buffered_budget_refuses_the_frame_that_would_pass_it() -> None:
    gate = admission(max_frame=1000)  # budget: twice the largest frame
    assert gate.max_buffered == 2000
    a = gate.admit("10.0.0.1", 10)
    b = gate.admit("10.0.0.2", 11)
    assert isinstance(a, Admitted) and isinstance(b, Admitted)
    assert gate.buffer(a, 900) is None
    assert gate.buffer(b, 1000) is None
    refused = gate.buffer(b, 1200)  # +200 would make 2100
    assert isinstance(refused, Refusal)
    assert (refused.cap, refused.limit) == ("buffered_bytes", 2000)
    assert gate.buffered == 1900  # the refused growth is not counted
    assert gate.buffer(a, 0) is None  # a's frame completed
    assert gate.buffer(b, 1200) is None
    gate.close(b)
    assert (gate.buffered, gate.buffered_peak, gate.refused["buffered_bytes"]) == (0, 1900, 1)


def test_shrinking_is_never_refused_even_over_budget() -> None:
    gate = admission(max_buffered=100)
    a = gate.admit(None, None)
    assert isinstance(a, Admitted)
    assert gate.buffer(a, 100) is None
    assert gate.buffer(a, 50) is None
    assert gate.buffered == 50


def test_refusal_log_says_the_first_then_one_line_per_interval_with_a_count() -> None:
    refusals = RefusalLog(interval=60)
    assert refusals.note("connections", 0.0) == 1
    assert [refusals.note("connections", t) for t in (1.0, 2.0, 30.0)] == [None, None, None]
    assert refusals.note("file_descriptors", 31.0) == 1  # each kind on its own
    assert refusals.note("connections", 61.0) == 4  # 3 quiet ones and this
    assert refusals.note("connections", 200.0) == 1


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_connections": 0}, "max_connections"),
        ({"max_per_address": True}, "max_per_address"),
        ({"spare_fds": 0}, "spare_fds"),
        ({"max_buffered": -1}, "max_buffered"),
        ({"idle_timeout": 0}, "idle_timeout"),
        ({"frame_timeout": float("inf")}, "frame_timeout"),
    ],
)
def test_connection_limits_refuse_nonsense_naming_the_field(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ConnectionLimits(**options)


def test_connection_limits_ride_on_limits_with_documented_defaults() -> None:
    limits = Limits()
    assert limits.connections == ConnectionLimits(
        max_connections=10_000, max_per_address=1_000, idle_timeout=300.0, frame_timeout=60.0
    )
    assert admission(max_frame=limits.max_frame).max_buffered == 128 * 1024 * 1024
    with pytest.raises(ValueError, match="connections"):
        Limits(connections={"max_connections": 5})  # type: ignore[arg-type]
