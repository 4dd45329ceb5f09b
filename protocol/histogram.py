"""A latency histogram cheap enough to feed with every message a server handles.

Servers count how late each message is at each stage of the delay path (the
scheduler fires it, realtime accepts it, realtime hands it out) and answer the
counts in STATUS; ``delaymq bench delay`` reads them there. Keeping every value
would grow with the traffic, so values go into log-linear buckets (as
HdrHistogram does): exact below 64, then 32 buckets per power of two, so a
bucket is at most 1/32 (about 3 %) of its values wide and 2^40 ms (35 years)
fits in 1,152 buckets. Recording is a few integer operations; the wire form
lists only the buckets in use.

A percentile answers the highest value of its bucket (capped at the largest
value recorded), so it never reads lower than the truth: lateness is not made
to look better than it was. Negative values (early) are counted apart and
recorded as 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Values below this are a bucket each; above, ``_SUB`` buckets per power of two.
_LINEAR = 64
_SUB_BITS = 5
#: Values at or above this are recorded as ``MAX_VALUE``.
_LIMIT = 1 << 40
MAX_VALUE = _LIMIT - 1


def bucket_of(value: int) -> int:
    """The bucket index of a value from 0 to ``MAX_VALUE``."""
    shift = value.bit_length() - (_SUB_BITS + 1)
    return value if shift <= 0 else (shift << _SUB_BITS) + (value >> shift)


_BUCKETS = bucket_of(MAX_VALUE) + 1


def bucket_bounds(index: int) -> tuple[int, int]:
    """The lowest and highest value of bucket ``index``."""
    if index < _LINEAR:
        return index, index
    shift = (index >> _SUB_BITS) - 1
    mantissa = index - (shift << _SUB_BITS)
    return mantissa << shift, ((mantissa + 1) << shift) - 1


class LatencyHistogram:
    """Counts of whole-number values (milliseconds of lateness) in log-linear buckets."""

    __slots__ = ("counts", "count", "total", "max", "min", "early")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.count = 0
        self.total = 0  # sum of the values recorded (negative ones as they were)
        self.max = 0  # the largest value recorded (0 while empty)
        self.min = 0  # the smallest
        self.early = 0  # values below 0

    def record(self, value: int) -> None:
        """Count one value."""
        self.record_many((value,))

    def record_many(self, values: Sequence[int]) -> None:
        """Count each of ``values`` (one call per batch: the loop stays in here)."""
        if not values:
            return
        top = max(values)
        bottom = min(values)
        if self.count:
            self.max = max(top, self.max)
            self.min = min(bottom, self.min)
        else:
            self.max = top
            self.min = bottom
        self.count += len(values)
        self.total += sum(values)
        counts = self.counts
        if bottom >= 0 and top < _LINEAR:  # the common case of a server keeping up: exact buckets
            for value in values:
                counts[value] += 1
            return
        if top < 0:  # all early (sent ahead of their moment): counted apart, as 0
            self.early += len(values)
            counts[0] += len(values)
            return
        for value in values:
            if value < _LINEAR:
                if value < 0:
                    self.early += 1
                    value = 0
                counts[value] += 1
            else:
                if value > MAX_VALUE:
                    value = MAX_VALUE
                shift = value.bit_length() - (_SUB_BITS + 1)
                counts[(shift << _SUB_BITS) + (value >> shift)] += 1

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s counts to these."""
        if not other.count:
            return
        for index, count in enumerate(other.counts):
            if count:
                self.counts[index] += count
        self.min = min(self.min, other.min) if self.count else other.min
        self.max = max(self.max, other.max) if self.count else other.max
        self.count += other.count
        self.total += other.total
        self.early += other.early

    def percentile(self, fraction: float) -> int:
        """The value ``fraction`` (0..1) of the counts are at or below (0 when empty)."""
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction is {fraction!r}, must be from 0 to 1")
        if not self.count:
            return 0
        # ceil, at least the first value; the epsilon keeps 0.99 * 100 (99.00000000000001) at 99
        rank = max(1, math.ceil(fraction * self.count - 1e-9))
        seen = 0
        for index, count in enumerate(self.counts):
            if count:
                seen += count
                if seen >= rank:
                    return min(bucket_bounds(index)[1], self.max)
        return self.max

    def summary(self) -> tuple[int, int, int]:
        """p50, p99 and max."""
        return self.percentile(0.5), self.percentile(0.99), self.max

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able map: the totals and the buckets in use as a flat [index, count, ...] list."""
        buckets: list[int] = []
        for index, count in enumerate(self.counts):
            if count:
                buckets += (index, count)
        return {
            "count": self.count,
            "total": self.total,
            "max": self.max,
            "min": self.min,
            "early": self.early,
            "buckets": buckets,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> LatencyHistogram:
        """The histogram ``to_wire`` described; a ``ValueError`` names a field that does not fit."""
        histogram = cls()
        for name in ("count", "total", "max", "min", "early"):
            value = data.get(name)
            if type(value) is not int:
                raise ValueError(f"latency histogram: {name} is {value!r}, must be an int")
            setattr(histogram, name, value)
        buckets = data.get("buckets")
        if not isinstance(buckets, list | tuple) or len(buckets) % 2:
            raise ValueError("latency histogram: buckets must be a list of index, count pairs")
        total = 0
        for position in range(0, len(buckets), 2):
            index, count = buckets[position], buckets[position + 1]
            if type(index) is not int or not 0 <= index < _BUCKETS:
                raise ValueError(f"latency histogram: bucket index {index!r} is not from 0 to {_BUCKETS - 1}")
            if type(count) is not int or count < 1:
                raise ValueError(f"latency histogram: bucket {index} has count {count!r}, must be a positive int")
            histogram.counts[index] += count
            total += count
        if total != histogram.count:
            raise ValueError(f"latency histogram: buckets hold {total} values, count says {histogram.count}")
        return histogram


__all__ = ["MAX_VALUE", "LatencyHistogram", "bucket_bounds", "bucket_of"]
