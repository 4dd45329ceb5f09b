"""HourWheel: non-empty hours as a sorted set, idle hours jumped over."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delaymq.wheel import HOUR_MS, HourWheel, WheelError, hour_of, hour_start_ms

# Hours up to ~114 years after the epoch: far beyond the two-year horizon.
hours_st = st.sets(st.integers(0, 1_000_000), max_size=60)


@given(hours_st, st.integers(0, 1_000_000))
def test_navigation_matches_a_sorted_list(hours, probe):
    wheel = HourWheel(hours)
    ordered = sorted(hours)
    assert len(wheel) == len(ordered)
    assert list(wheel) == ordered
    assert wheel.first() == (ordered[0] if ordered else None)
    after = [h for h in ordered if h > probe]
    assert wheel.next_after(probe) == (after[0] if after else None)
    assert (probe in wheel) == (probe in hours)


@given(hours_st, st.integers(0, 1_000_000), st.integers(0, 1_000_000))
def test_hours_between_is_half_open(hours, a, b):
    wheel = HourWheel(hours)
    assert wheel.hours_between(a, b) == sorted(h for h in hours if a <= h < b)


@given(hours_st, st.integers(0, 1_000_000 * HOUR_MS), st.integers(0, 3 * HOUR_MS))
def test_due_hours_are_those_starting_by_now_plus_lookahead(hours, now_ms, lookahead_ms):
    wheel = HourWheel(hours)
    expected = sorted(h for h in hours if hour_start_ms(h) <= now_ms + lookahead_ms)
    assert wheel.due_hours(now_ms, lookahead_ms) == expected


def test_idle_years_are_jumped_in_one_step():
    now_hour = hour_of(1_700_000_000_000)
    wheel = HourWheel([now_hour, now_hour + 2 * 366 * 24])
    assert wheel.next_after(now_hour) == now_hour + 2 * 366 * 24
    wheel.discard(now_hour)
    assert wheel.first() == now_hour + 2 * 366 * 24
    assert wheel.due_hours(hour_start_ms(now_hour + 1), 0) == []
    wheel.discard(now_hour + 2 * 366 * 24)
    wheel.discard(12345)  # absent: ignored
    assert wheel.first() is None and wheel.next_after(0) is None and len(wheel) == 0


def test_add_is_idempotent_and_overdue_hours_come_oldest_first():
    wheel = HourWheel()
    for h in (50, 10, 30, 10):
        wheel.add(h)
    assert list(wheel) == [10, 30, 50]
    assert wheel.due_hours(hour_start_ms(40), 0) == [10, 30]
    assert wheel.due_hours(hour_start_ms(40), 10 * HOUR_MS) == [10, 30, 50]


def test_hour_helpers_are_utc_buckets():
    assert hour_of(HOUR_MS - 1) == 0 and hour_of(HOUR_MS) == 1
    assert hour_start_ms(hour_of(1_700_000_123_456)) == 1_700_000_123_456 // HOUR_MS * HOUR_MS


@pytest.mark.parametrize("bad", [-1, 1.5, "3"])
def test_bad_hours_are_refused_naming_the_field(bad):
    with pytest.raises(WheelError, match="hour="):
        HourWheel().add(bad)


def test_negative_lookahead_is_refused():
    with pytest.raises(WheelError, match="lookahead_ms=-1"):
        HourWheel([1]).due_hours(0, -1)
