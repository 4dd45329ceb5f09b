"""The latency histogram servers keep per stage: percentiles close to the exact ones and never lower."""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.protocol.histogram import MAX_VALUE, LatencyHistogram, bucket_bounds, bucket_of


def exact_percentile(values: list[int], fraction: float) -> int:
    """Nearest rank: the smallest value with at least ``fraction`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(fraction * len(ordered) - 1e-9)) - 1]


def test_buckets_cover_every_value_once_and_are_at_most_a_32nd_wide() -> None:
    previous_high = -1
    for index in range(bucket_of(MAX_VALUE) + 1):
        low, high = bucket_bounds(index)
        assert low == previous_high + 1  # no gap, no overlap
        assert high - low + 1 <= max(1, low // 32)
        assert bucket_of(low) == index and bucket_of(high) == index
        previous_high = high
    assert previous_high == MAX_VALUE


def test_values_below_64_are_exact() -> None:
    histogram = LatencyHistogram()
    histogram.record_many([3] * 50 + [7] * 49 + [63])
    assert histogram.summary() == (3, 7, 63)
    assert histogram.count == 100 and histogram.total == 150 + 343 + 63


@given(
    st.lists(st.integers(min_value=-1_000, max_value=10**9), min_size=1, max_size=300),
    st.sampled_from([0.5, 0.99, 1.0]),
)
def test_percentile_is_never_below_the_exact_one_and_at_most_a_32nd_above(values: list[int], fraction: float) -> None:
    histogram = LatencyHistogram()
    half = len(values) // 2
    histogram.record_many(values[:half])
    histogram.record_many(values[half:])
    exact = exact_percentile(values, fraction)
    answered = histogram.percentile(fraction)
    if max(values) < 0:  # all early: the largest (least early) value
        assert answered == max(values)
    else:
        floor = max(exact, 0)  # early values count as on time in the buckets
        assert floor <= answered <= floor + floor // 32
    assert histogram.max == max(values) and histogram.min == min(values)
    assert histogram.early == sum(1 for value in values if value < 0)
    assert histogram.count == len(values) and histogram.total == sum(values)


def test_a_negative_value_counts_as_early() -> None:
    histogram = LatencyHistogram()
    histogram.record_many([-5, 10, 20])
    assert histogram.early == 1
    assert histogram.min == -5
    assert histogram.percentile(0.0) == 0  # recorded as on time


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(min_value=-200, max_value=5_000), min_size=1, max_size=20), max_size=8))
def test_batches_count_as_their_values_one_by_one(batches: list[list[int]]) -> None:
    """Batch by batch (all early, all exact, mixed, in any order) or value by value: the same counts."""
    batched, single = LatencyHistogram(), LatencyHistogram()
    for batch in batches:
        batched.record_many(batch)
        for value in batch:
            single.record(value)
    assert batched.counts == single.counts
    assert (batched.count, batched.total, batched.early, batched.min, batched.max) == (
        single.count,
        single.total,
        single.early,
        single.min,
        single.max,
    )


def test_values_beyond_the_range_land_in_the_last_bucket_and_keep_their_max() -> None:
    histogram = LatencyHistogram()
    histogram.record(MAX_VALUE * 4)
    assert histogram.max == MAX_VALUE * 4
    assert histogram.percentile(0.5) == MAX_VALUE


def test_wire_form_survives_msgpack_and_merging_adds_up() -> None:
    one, two, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    first = [1, 5, 80, 700, 12_345]
    second = [-3, 2, 90, 40_000]
    one.record_many(first)
    two.record_many(second)
    both.record_many(first + second)
    received = LatencyHistogram.from_wire(msgpack.unpackb(msgpack.packb(one.to_wire())))
    assert received.to_wire() == one.to_wire()
    received.merge(two)
    assert received.to_wire() == both.to_wire()
    empty = LatencyHistogram()
    empty.merge(two)
    assert empty.to_wire() == two.to_wire()


def test_an_empty_histogram_answers_zeros() -> None:
    histogram = LatencyHistogram()
    histogram.record_many([])
    assert histogram.summary() == (0, 0, 0) and histogram.mean == 0.0
    assert LatencyHistogram.from_wire(histogram.to_wire()).count == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"count": "3"}, "count"),
        ({"buckets": [1]}, "buckets"),
        ({"buckets": [99_999, 1]}, "bucket index"),
        ({"buckets": [1, 0]}, "count 0"),
        ({"count": 7}, "count says 7"),
    ],
)
def test_a_bad_wire_form_is_refused_naming_the_field(change: dict, field: str) -> None:
    histogram = LatencyHistogram()
    histogram.record(1)
    with pytest.raises(ValueError, match=field):
        LatencyHistogram.from_wire({**histogram.to_wire(), **change})


def test_percentile_refuses_a_fraction_outside_0_to_1() -> None:
    with pytest.raises(ValueError, match="fraction"):
        LatencyHistogram().percentile(99)
