"""Tick: a small fixed binary for the 50 ms master -> slave stream."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.wheel import NO_LIMIT, TICK_SIZE, Tick, WheelError


@given(st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1))
def test_encode_decode_round_trip(second, done, limit):
    tick = Tick(second, done, limit)
    data = tick.encode()
    assert len(data) == TICK_SIZE == 17
    assert Tick.decode(data) == tick
    assert Tick.decode(memoryview(bytearray(data))) == tick


def test_defaults_claim_nothing_of_the_second_and_cover_every_entry():
    tick = Tick(1_700_000_000)
    assert (tick.done, tick.limit) == (0, NO_LIMIT)
    assert tick.hour == 1_700_000_000 // 3600
    assert Tick.start_of(5) == Tick(5 * 3600, 0, 0)


def test_tick_is_frozen():
    with pytest.raises(AttributeError):
        Tick(1).done = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("args", "field"),
    [((-1,), "second="), ((1, -1), "done="), ((1, 2**32), "done="), ((1, 0, 2**32), "limit=")],
)
def test_out_of_range_fields_are_refused_by_name(args, field):
    with pytest.raises(WheelError, match=field):
        Tick(*args)


def test_decode_refuses_wrong_size_and_version():
    data = Tick(10, 2, 3).encode()
    with pytest.raises(WheelError, match="size=16"):
        Tick.decode(data[:-1])
    with pytest.raises(WheelError, match="version=9"):
        Tick.decode(b"\x09" + data[1:])
