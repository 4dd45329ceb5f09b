"""The dispatcher against a real schedule store and a fake realtime (``deliver``), no sockets.

Under ``autojump_clock`` with disk work inline, so backoffs and due times cost nothing.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from delaymq.metaserver.server import run_inline
from delaymq.protocol.records import encode_message, scan_batch
from delaymq.scheduler.dispatcher import Deliver, Dispatcher
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.schedulelog import ScheduleStore
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.log import SegmentedLog
from delaymq.storage.state import StateStore
from delaymq.wheel import HOUR_MS
from delaymq.wheel.clock import TrioClock

EPOCH_MS = 1_749_996_000_000  # 2025-06-15 14:00 UTC


@asynccontextmanager
async def running(
    tmp_path: Path, records: list[bytes], deliver: Deliver, **options: int
) -> AsyncIterator[tuple[Dispatcher, TrioClock]]:
    clock = TrioClock(EPOCH_MS)
    with (
        SegmentedLog.open(tmp_path / "messages") as log,
        StateStore.open(tmp_path / "state") as state,
        ScheduleStore.open(tmp_path / "schedule", state, fsync=False) as store,
    ):
        log.append(b"".join(records))
        log.flush()
        replay_until_caught_up(log, store)
        max_loaded = options.pop("max_loaded", 500_000)
        wheels = WheelSet(store.undispatched_hours(), max_loaded=max_loaded)
        dispatcher = Dispatcher(
            store=store, wheels=wheels, deliver=deliver, clock=clock, run_blocking=run_inline, **options
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(dispatcher.run)
            yield dispatcher, clock
            nursery.cancel_scope.cancel()


def message(name: str, subject: str, deliver_at: int) -> bytes:
    return encode_message(name, subject, deliver_at=deliver_at, created_at=EPOCH_MS)


async def test_a_failing_subject_is_retried_in_order_while_others_go_on_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    records = [message(f"{s}{i}", s, EPOCH_MS + 1_000 + 100 * i) for i in range(10) for s in "ab"]
    got: list[tuple[str, int]] = []
    calls = {"a": 0}
    clock_box: list[TrioClock] = []
    all_in = trio.Event()

    async def deliver(subject: str, body: bytes) -> list[str]:
        if subject == "a":
            calls["a"] += 1
            if calls["a"] <= 4:
                raise ConnectionError(f"realtime refused attempt {calls['a']}")
        batch = scan_batch(body)
        got.extend((name, clock_box[0].now_ms()) for name in batch.ids)
        if len(got) == 20:
            all_in.set()
        return ["stored"] * len(batch)

    caplog.set_level(logging.WARNING, logger="delaymq.scheduler.dispatcher")
    async with running(tmp_path, records, deliver, backoff_ms=100, max_backoff_ms=400) as (dispatcher, clock):
        clock_box.append(clock)
        await all_in.wait()
        stats = dispatcher.statistics()
    b = [(name, at) for name, at in got if name.startswith("b")]
    assert [name for name, _ in b] == [f"b{i}" for i in range(10)]
    assert all(at == EPOCH_MS + 1_000 + 100 * int(name[1:]) for name, at in b)  # on time throughout
    a = [name for name, _ in got if name.startswith("a")]
    assert a == [f"a{i}" for i in range(10)]  # late, in order, none lost or doubled
    assert stats.failures == 4 and stats.dispatched == 20 and not stats.in_outage
    outage = [r.getMessage() for r in caplog.records]
    assert len(outage) == 2  # once when it began, once when it ended
    assert "retrying with backoff" in outage[0] and "works again after 4 failed" in outage[1]


async def test_an_overdue_backlog_goes_oldest_first_within_the_memory_budget(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    hours_ago = [5, 3, 2]
    records = [message(f"h{h}-{i:04d}", "s", EPOCH_MS - h * HOUR_MS + 700 * i) for h in hours_ago for i in range(600)]
    got: list[str] = []
    most_loaded = 0
    box: list[Dispatcher] = []
    all_in = trio.Event()

    async def deliver(subject: str, body: bytes) -> list[str]:
        nonlocal most_loaded
        most_loaded = max(most_loaded, box[0].wheels.loaded_entries())
        ids = scan_batch(body).ids
        got.extend(ids)
        if len(got) == len(records):
            all_in.set()
        return ["stored"] * len(ids)

    async with running(tmp_path, records[::-1], deliver, max_loaded=50) as (dispatcher, _clock):
        box.append(dispatcher)
        await all_in.wait()
        stats = dispatcher.statistics()
    assert got == sorted(got, key=lambda name: (-int(name[1]), name))  # oldest hour, then oldest message
    assert len(set(got)) == len(records)
    assert most_loaded <= 50 + 2  # the budget, overshot by at most one second's entries
    assert stats.lateness_max_ms >= 5 * HOUR_MS - 1  # they were overdue, and went out at once
