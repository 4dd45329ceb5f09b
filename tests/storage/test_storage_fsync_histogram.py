"""The log writer times each fsync: a slow disk shows in its fsync-duration histogram."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from delaymq.protocol.envelope import RecordKind, encode
from delaymq.protocol.histogram import LatencyHistogram
from delaymq.storage.log import SegmentedLog
from delaymq.storage.writer import open_log_writer

SLOW_FSYNC_S = 0.02


@pytest.fixture
def slow_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync of the log takes at least 20 ms (a disk under load)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        time.sleep(SLOW_FSYNC_S)
        real_fsync(fd)

    monkeypatch.setattr("delaymq.storage.log.os.fsync", fsync)


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_each_fsync_is_timed_and_a_slow_one_reads_slow(tmp_path: Path, slow_fsync: None, flush: str) -> None:
    with SegmentedLog.open(tmp_path, segment_size=1 << 20) as log:
        async with open_log_writer(log, flush=flush, flush_interval_ms=600_000) as writer:  # type: ignore[arg-type]
            assert LatencyHistogram.from_wire(writer.fsync_durations_us()).count == 0
            for n in range(3):
                await writer.append(encode(RecordKind.MESSAGE, f"record {n}".encode()))
        # sync: one fsync per append (each waited for its own); async: the one on close.
        durations = LatencyHistogram.from_wire(writer.fsync_durations_us())
        assert durations.count == writer.statistics().fsyncs == (3 if flush == "sync" else 1)
        assert durations.min >= SLOW_FSYNC_S * 1_000_000  # microseconds, never lower than it took
        assert durations.max < 60 * 1_000_000
