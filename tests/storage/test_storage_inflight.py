"""Keys of appends under way: a request meeting one waits for that append to end."""

from __future__ import annotations

from delaymq.storage.inflight import KeysInFlight


def test_a_key_being_appended_is_waited_for_until_its_append_ends() -> None:
    in_flight = KeysInFlight()
    assert not in_flight and in_flight.waiting_for(["a"]) is None
    first = in_flight.start(["a", "b"])
    second = in_flight.start(["c"])
    assert in_flight and "b" in in_flight and "z" not in in_flight
    assert in_flight.waiting_for(["z", "b"]) is first
    assert in_flight.waiting_for(["c"]) is second
    assert in_flight.waiting_for(["x", "y"]) is None
    in_flight.end(first)
    assert first.is_set() and not second.is_set()
    assert in_flight.waiting_for(["a", "b"]) is None and "a" not in in_flight
    in_flight.end(second)
    assert not in_flight
