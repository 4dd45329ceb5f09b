"""Accepting goes first, filing follows (``FilingPace``): replay waits while SCHEDULEs keep
coming, never past what falls due soon, a CANCEL, ``max_wait_ms`` or ``max_bytes``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from delaymq.scheduler.dispatcher import DEFAULT_SEND_AHEAD_MS
from delaymq.scheduler.filingpace import (
    DEFAULT_FILING_LEAD_MS,
    DEFAULT_FILING_MAX_WAIT_MS,
    DEFAULT_FILING_QUIET_MS,
    FilingPace,
)

NOW = 1_749_996_000_000  # wall ms
MONO = 5_000_000  # monotonic ms
FAR = NOW + 3_600_000


def pace(**options: int) -> FilingPace:
    settings = {"lead_ms": 1_000, "quiet_ms": 20, "max_wait_ms": 1_000, "max_bytes": 1 << 20, **options}
    return FilingPace(**settings)


def wait(p: FilingPace, *, after_ms: int = 0, unfiled: int = 100, wall_step_ms: int = 0) -> int:
    return p.wait_ms(now_ms=NOW + after_ms + wall_step_ms, monotonic_ms=MONO + after_ms, unfiled_bytes=unfiled)


def test_nothing_appended_here_is_filed_at_once() -> None:
    assert wait(pace(), unfiled=500) == 0  # e.g. a log with records from before this session


def test_a_batch_due_far_ahead_waits_for_a_pause_in_accepting() -> None:
    p = pace()
    p.appended(100, FAR, MONO)
    assert wait(p) == 20
    assert wait(p, after_ms=15) == 5
    p.appended(200, FAR, MONO + 15)  # another SCHEDULE: the pause starts again
    assert wait(p, after_ms=15) == 20
    assert wait(p, after_ms=35) == 0
    assert p.statistics().waits == 3


def test_a_steady_stream_is_filed_within_max_wait_of_its_first_append() -> None:
    p = pace()
    for ms in range(0, 1_000, 10):  # a SCHEDULE every 10 ms: never a 20 ms pause
        p.appended(ms + 1, FAR, MONO + ms)
        assert wait(p, after_ms=ms) == min(20, 1_000 - ms)
    assert wait(p, after_ms=1_000) == 0
    p.filed(500)  # the appends up to offset 500 are filed: the wait counts from the next one
    assert wait(p, after_ms=1_000) == 10


def test_anything_due_within_the_lead_or_a_cancel_is_filed_at_once() -> None:
    p = pace()
    p.appended(100, FAR, MONO)
    p.appended(200, NOW + 900, MONO)
    assert wait(p) == 0  # due within the lead (1 s): no waiting for a pause
    p.filed(200)
    p.appended(300, FAR, MONO)
    p.appended(400, None, MONO)  # a CANCEL or MOVE
    assert wait(p) == 0
    p.filed(400)
    p.appended(500, NOW + 1_010, MONO)
    assert wait(p) == 10  # due in 1,010 ms: filed 10 ms from now, within the pause


def test_filing_the_batch_due_soon_lets_the_far_ones_wait_again() -> None:
    p = pace()
    p.appended(100, NOW + 500, MONO)
    p.appended(200, FAR, MONO)
    assert wait(p) == 0
    p.filed(100)
    assert wait(p) == 20


def test_max_bytes_unfiled_files_at_once() -> None:
    p = pace(max_bytes=1_000)
    p.appended(100, FAR, MONO)
    assert wait(p, unfiled=999) == 20
    assert wait(p, unfiled=1_000) == 0


def test_a_step_of_the_wall_clock_does_not_stretch_the_wait() -> None:
    p = pace()
    p.appended(100, FAR, MONO)
    assert wait(p, wall_step_ms=-600_000) == 20  # the wall clock went back ten minutes
    assert wait(p, after_ms=20, wall_step_ms=-600_000) == 0
    assert wait(p, wall_step_ms=FAR - NOW) == 0  # forward past deliver_at: due now


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lead_ms", -1, "lead_ms must be >= 0, got -1"),
        ("quiet_ms", -5, "quiet_ms must be >= 0, got -5"),
        ("max_wait_ms", -1, "max_wait_ms must be >= 0, got -1"),
        ("max_bytes", 0, "max_bytes must be at least 1, got 0"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pace(**{field: value})


async def test_a_message_due_soon_is_on_time_while_a_stream_of_far_ones_keeps_filing_waiting(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A producer sends far-future batches every 10 ms for 3 s (never a pause); messages due
    0.5 s after they are sent, sent in the middle of it, still arrive on time: filing does not
    wait for them. Everything is filed within ``max_wait`` of being accepted meanwhile."""
    assert DEFAULT_SEND_AHEAD_MS + DEFAULT_FILING_LEAD_MS > 500  # what makes "due soon"
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler() as scheduler:
        clock = cluster.clock
        receiver = cluster.receiver()
        start = clock.monotonic_ms()
        soon: dict[str, int] = {}
        most_unfiled = batch_bytes = 0
        n = 0
        while clock.monotonic_ms() - start < 3_000:
            now = clock.now_ms()
            records = [sched.message(f"far-{n}-{i}", now + 3_600_000) for i in range(20)]
            if n % 37 == 5:
                soon[f"soon-{n}"] = now + 500
                records.append(sched.message(f"soon-{n}", now + 500))
            await cluster.schedule_raw(records)
            batch_bytes = max(batch_bytes, sum(map(len, records)))
            most_unfiled = max(most_unfiled, scheduler.statistics().unfiled_bytes)
            n += 1
            await clock.sleep_ms(DEFAULT_FILING_QUIET_MS // 2)
        got = await receiver.wait_for(len(soon))
        assert sorted(r.id for r in got) == sorted(soon)
        assert all(soon[r.id] == r.deliver_at <= r.received_at < r.deliver_at + 100 for r in got)
        batches = DEFAULT_FILING_MAX_WAIT_MS // (DEFAULT_FILING_QUIET_MS // 2)
        assert 10 * batch_bytes < most_unfiled <= (batches + 1) * batch_bytes  # filing waited, not past max_wait
        await sched.filed(scheduler)  # and catches up once the stream stops
