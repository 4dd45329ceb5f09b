"""Sets of ``[start, end)`` sequence ranges, merged as they arrive in any order.

Acks travel and are kept as ranges: a consumer merges the sequences it settled
into a few ranges to send (``RangeSet``), and both ends track a pull log's
progress as an acked position plus the done ranges above it (``AckRanges``).
Sans-IO; the cost of an addition grows with the number of gaps, not of sequences.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class RangeSet:
    """Sorted, disjoint, non-touching ``[start, end)`` ranges; adding merges neighbours."""

    __slots__ = ("_starts", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        if start >= end:
            return
        starts, ends = self._starts, self._ends
        low = bisect.bisect_left(ends, start)  # first range ending at or after start
        high = bisect.bisect_right(starts, end)  # past the last range starting at or before end
        if low < high:
            start = min(start, starts[low])
            end = max(end, ends[high - 1])
        starts[low:high] = [start]
        ends[low:high] = [end]

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        index = bisect.bisect_right(self._starts, value) - 1
        return index >= 0 and value < self._ends[index]

    def first(self) -> tuple[int, int] | None:
        return (self._starts[0], self._ends[0]) if self._starts else None

    def pop_first(self) -> tuple[int, int]:
        return self._starts.pop(0), self._ends.pop(0)

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def take(self) -> list[tuple[int, int]]:
        """Every range, and empty the set."""
        ranges = self.ranges()
        self._starts, self._ends = [], []
        return ranges

    def total(self) -> int:
        return sum(end - start for start, end in zip(self._starts, self._ends))

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not in the set, in order."""
        gaps: list[tuple[int, int]] = []
        if start >= end:
            return gaps
        starts, ends = self._starts, self._ends
        index = bisect.bisect_right(ends, start)
        position = start
        while position < end:
            if index < len(starts) and starts[index] <= position:
                position = ends[index]
                index += 1
                continue
            gap_end = min(end, starts[index]) if index < len(starts) else end
            gaps.append((position, gap_end))
            position = gap_end
        return gaps

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    def __repr__(self) -> str:
        return f"RangeSet({self.ranges()})"


class AckRanges:
    """A pull log's progress: ``acked``, and the done ranges above it.

    Everything below ``acked`` is done (acked, or given back to the group); the
    ranges are sorted, disjoint, not touching each other and all above
    ``acked``. Marking merges, and moves ``acked`` when the first gap fills, so
    the ranges stay as few as the gaps.
    """

    __slots__ = ("acked", "_done")

    def __init__(self, acked: int = 0, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self.acked = acked
        self._done = RangeSet()
        for start, end in ranges:
            self.mark(start, end)

    def ranges(self) -> list[tuple[int, int]]:
        return self._done.ranges()

    def mark(self, start: int, end: int) -> None:
        """Mark ``[start, end)`` done (already-done parts are fine)."""
        done = self._done
        done.add(max(start, self.acked), end)
        first = done.first()
        if first is not None and first[0] <= self.acked:
            self.acked = done.pop_first()[1]

    def is_done(self, sequence: int) -> bool:
        return sequence < self.acked or sequence in self._done

    def undone(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` not done yet, in order."""
        return self._done.gaps(max(start, self.acked), end)

    def done_above(self) -> int:
        """How many sequences at or above ``acked`` are done."""
        return self._done.total()

    def __repr__(self) -> str:
        return f"AckRanges(acked={self.acked}, ranges={self.ranges()})"


__all__ = ["AckRanges", "RangeSet"]
