"""The shared range sets: gaps, acked progress, and the connect backoff both peer pools use."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.net.connection import PeerUnavailable
from delaymq.net.peers import ConnectBackoff
from delaymq.protocol.ranges import AckRanges, RangeSet


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 8)), max_size=30),
    st.integers(0, 60),
    st.integers(0, 60),
)
def test_gaps_are_exactly_what_the_set_lacks(pieces: list[tuple[int, int]], start: int, end: int) -> None:
    ranges = RangeSet((begin, begin + length) for begin, length in pieces)
    held = {n for begin, length in pieces for n in range(begin, begin + length)}
    gaps = ranges.gaps(start, end)
    assert [n for gap_start, gap_end in gaps for n in range(gap_start, gap_end)] == [
        n for n in range(start, end) if n not in held
    ]
    assert all(a_end < b_start for (_, a_end), (b_start, _) in zip(gaps, gaps[1:]))  # maximal gaps


def test_ack_ranges_count_what_is_done_above_the_acked_position() -> None:
    progress = AckRanges(3, [(5, 7), (9, 10)])
    assert (progress.acked, progress.ranges(), progress.done_above()) == (3, [(5, 7), (9, 10)], 3)
    progress.mark(3, 5)
    assert (progress.acked, progress.ranges(), progress.done_above()) == (7, [(9, 10)], 1)
    assert progress.is_done(0) and not progress.is_done(8)


def test_connect_backoff_doubles_up_to_its_maximum_and_ends_on_a_connect() -> None:
    backoff = ConnectBackoff(0.1, 0.3, random=lambda: 0.999)  # the top of each jittered range: the ceilings
    backoff.check("a:1", 0.0)
    waits = []
    for now in (0.0, 10.0, 20.0):
        backoff.failed("a:1", now)
        with pytest.raises(PeerUnavailable, match=r"^a:1 is unreachable; next attempt in"):
            backoff.check("a:1", now)
        waits.append(next(w for w in (0.1, 0.2, 0.3) if not _waiting(backoff, now + w)))
    assert waits == [0.1, 0.2, 0.3]
    backoff.check("b:2", 20.0)  # other peers are not affected
    backoff.connected("a:1")
    backoff.check("a:1", 20.0)


def _waiting(backoff: ConnectBackoff, now: float) -> bool:
    try:
        backoff.check("a:1", now)
    except PeerUnavailable:
        return True
    return False
