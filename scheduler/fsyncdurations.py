"""How long the schedule store's fsyncs take: recorded in the thread that fsyncs, read
from the event loop's.

Filing fsyncs in the replay worker and dispatch-log flushes in the dispatcher's, while
``statistics()`` reads the histogram on the trio thread. A ``LatencyHistogram`` is
several fields, so both hold a small lock of the histogram's own (never the store's
locks): one record per fsync, one ``to_wire`` per snapshot; a scrape never sees a
count that its buckets do not add up to. The metrics endpoint shows them as
``delaymq_fsync_duration_seconds`` (``log="schedule"``, ``log="dispatch"``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from delaymq.protocol.histogram import LatencyHistogram


class FsyncDurations:
    """Durations of one kind of fsync, in microseconds (``LatencyHistogram``).

    Time a call as ``started = fsync_clock(); os.fdatasync(fd); durations.since(started)``:
    two monotonic reads around the fsync, in the thread doing it."""

    __slots__ = ("_histogram", "_lock")

    def __init__(self) -> None:
        self._histogram = LatencyHistogram()
        self._lock = threading.Lock()

    def since(self, started_ns: int) -> None:
        """Count one fsync that began at ``started_ns`` (``fsync_clock()``) and ended now."""
        elapsed_us = (time.perf_counter_ns() - started_ns) // 1000
        with self._lock:
            self._histogram.record(elapsed_us)

    def to_wire(self) -> dict[str, Any]:
        """The histogram as ``LatencyHistogram.to_wire`` gives it, never half updated."""
        with self._lock:
            return self._histogram.to_wire()


#: The monotonic clock ``FsyncDurations.since`` reads, in nanoseconds.
fsync_clock = time.perf_counter_ns


__all__ = ["FsyncDurations", "fsync_clock"]
