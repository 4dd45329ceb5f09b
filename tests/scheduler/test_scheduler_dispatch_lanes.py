"""The dispatcher against a real schedule store and a fake realtime (``deliver``), no sockets.

Under ``autojump_clock`` with disk work inline, so backoffs and due times cost nothing.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from delaymq.clock import TrioClock
from delaymq.protocol.backoff import RandomSource
from delaymq.protocol.records import encode_message, scan_batch
from delaymq.scheduler.dispatcher import Deliver, Dispatcher, DispatcherStatistics
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.threads import run_inline
from delaymq.wheel import HOUR_MS

from .conftest import schedule_folder

EPOCH_MS = 1_749_996_000_000  # 2025-06-15 14:00 UTC


@asynccontextmanager
async def running(
    tmp_path: Path, records: list[bytes], deliver: Deliver, **options: Any
) -> AsyncIterator[tuple[Dispatcher, TrioClock]]:
    clock = TrioClock(EPOCH_MS)
    with schedule_folder(tmp_path, fsync=False) as (log, store):
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


#: The lanes' retry waits below: ``backoff_ms=100`` doubling to ``max_backoff_ms=800``.
LANE_CEILINGS_MS = [100, 200, 400, 800, 800]


async def lane_waits_while_down(tmp_path: Path, lanes: int, source: RandomSource) -> list[list[int]]:
    """Each subject's waits (ms) between its SEND attempts, realtime refusing the first ones of all."""
    attempts: defaultdict[str, list[float]] = defaultdict(list)
    delivered: set[str] = set()
    all_in = trio.Event()

    async def deliver(subject: str, body: bytes) -> list[str]:
        attempts[subject].append(trio.current_time())
        if len(attempts[subject]) <= len(LANE_CEILINGS_MS):
            raise ConnectionError("realtime is down")
        delivered.add(subject)
        if len(delivered) == lanes:
            all_in.set()
        return ["stored"] * len(scan_batch(body))

    records = [message(f"s{n}-0", f"s{n}", EPOCH_MS + 1_000) for n in range(lanes)]  # all due at once
    async with running(tmp_path, records, deliver, backoff_ms=100, max_backoff_ms=800, random=source):
        with trio.fail_after(60):  # on the mock clock: the waits add up to under 3 s
            await all_in.wait()
    return [[round((b - a) * 1000) for a, b in zip(at, at[1:])] for at in attempts.values()]


async def test_lanes_that_failed_together_retry_spread_out_never_in_a_tight_loop(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    waits = await lane_waits_while_down(tmp_path, 16, random.Random(9).random)
    assert len(waits) == 16
    for n, ceiling in enumerate(LANE_CEILINGS_MS):
        nth = [each[n] for each in waits]
        assert all(ceiling // 2 <= wait <= ceiling for wait in nth), (n, nth)  # the floor, the cap
        assert len(set(nth)) > 8, (n, nth)  # not in lockstep


@pytest.mark.parametrize(
    ("source", "expected"),
    [(lambda: 0.0, [c // 2 for c in LANE_CEILINGS_MS]), (lambda: 1 - 1e-9, [c - 1 for c in LANE_CEILINGS_MS])],
    ids=["floor", "ceiling"],
)
async def test_the_extremes_of_the_random_source_give_the_floor_and_the_ceiling(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, source: RandomSource, expected: list[int]
) -> None:
    assert await lane_waits_while_down(tmp_path, 2, source) == [expected, expected]


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


@pytest.mark.parametrize("interval_ms", [0, 10])
async def test_a_send_interval_gathers_what_falls_due_into_fewer_sends_never_early(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, interval_ms: int
) -> None:
    """One message due each millisecond for 200 ms, a SEND taking 1 ms: without an interval
    a SEND per message or two; with 10 ms, a SEND per 10 ms, each message at most the
    interval (and the firer's slack) late, in order, none early."""
    records = [message(f"m{i:03}", "orders", EPOCH_MS + 1_000 + i) for i in range(200)]
    got: list[tuple[str, int]] = []
    sends: list[int] = []
    all_in = trio.Event()
    clock_box: list[TrioClock] = []

    async def deliver(subject: str, body: bytes) -> list[str]:
        sends.append(clock_box[0].now_ms())
        await trio.sleep(0.001)  # the round trip
        batch = scan_batch(body)
        got.extend((name, clock_box[0].now_ms()) for name in batch.ids)
        if len(got) == len(records):
            all_in.set()
        return ["stored"] * len(batch)

    async with running(tmp_path, records, deliver, send_interval_ms=interval_ms) as (dispatcher, clock):
        clock_box.append(clock)
        await all_in.wait()
        fire_rounds = dispatcher.statistics().fire_rounds
    assert [name for name, _ in got] == [f"m{i:03}" for i in range(200)]  # in order, once each
    lateness = [at - (EPOCH_MS + 1_000 + int(name[1:])) for name, at in got]
    assert min(lateness) >= 0  # never early
    if interval_ms:
        assert all(b - a >= interval_ms for a, b in zip(sends, sends[1:])), sends
        assert len(sends) <= 200 // interval_ms + 2
        assert max(lateness) <= interval_ms + 1 + 2  # the interval, the round trip, the firer's slack
        assert fire_rounds <= len(sends) + 2, (fire_rounds, len(sends))  # the waiting lane fires, not the firer
    else:
        assert len(sends) >= 200 // 2  # the round trip sets the pace


async def sent_at(
    tmp_path: Path, records: list[bytes], *, round_trip_s: float = 0.0, **options: Any
) -> tuple[dict[str, int], DispatcherStatistics]:
    """Run the dispatcher until (a fake) realtime holds every record, each SENT once: when
    the SEND carrying each started (wall ms), in order, and the statistics then."""
    sent: dict[str, int] = {}
    all_in = trio.Event()
    clock_box: list[TrioClock] = []

    async def deliver(subject: str, body: bytes) -> list[str]:
        started = clock_box[0].now_ms()
        if round_trip_s:
            await trio.sleep(round_trip_s)
        batch = scan_batch(body)
        assert sent.keys().isdisjoint(batch.ids), "a record SENT twice"
        sent.update((name, started) for name in batch.ids)
        if len(sent) == len(records):
            all_in.set()
        return ["stored"] * len(batch)

    async with running(tmp_path, records, deliver, **options) as (dispatcher, clock):
        clock_box.append(clock)
        await all_in.wait()
        return sent, dispatcher.statistics()


async def test_send_ahead_sends_each_message_that_long_before_its_time_never_sooner(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """50 ms ahead with a 20 ms send interval: every message reaches (the fake) realtime
    between 50 ms and 50 - 20 - 1 - 2 ms before it is due, in order, once; the lateness
    the dispatcher reports is measured against the wall clock (negative: ahead)."""
    due = {f"m{i:03}": EPOCH_MS + 1_000 + i for i in range(200)}
    records = [message(name, "orders", at) for name, at in due.items()]
    sent, stats = await sent_at(tmp_path, records, round_trip_s=0.001, send_interval_ms=20, send_ahead_ms=50)
    assert list(sent) == list(due)
    ahead = [due[name] - at for name, at in sent.items()]
    assert max(ahead) <= 50  # never sooner than the send-ahead
    assert min(ahead) >= 50 - 20 - 2  # at most the interval and the firer's slack later than that
    assert stats.lateness_mean_ms < -(50 - 20 - 2 - 1)  # accepted before the moment, by the wall clock
    fired = stats.lateness_fired
    assert fired["max"] <= -(50 - 20 - 2) and fired["min"] >= -50


async def test_send_ahead_is_bounded_and_not_negative() -> None:
    with pytest.raises(ValueError, match="send_ahead_ms must be at least 0"):
        Dispatcher(
            store=None,  # type: ignore[arg-type]
            wheels=WheelSet([]),
            deliver=None,  # type: ignore[arg-type]
            clock=TrioClock(EPOCH_MS),
            run_blocking=run_inline,
            send_ahead_ms=-1,
        )


async def test_sent_ahead_a_record_created_at_or_after_its_due_time_waits_for_it_in_the_lane(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Realtime holds a record sent ahead only if it was created before it is due; one that
    was not (a producer's clock ahead of a mover's, a hand-made record) leaves the lane at
    its own moment by the wall clock, and those behind it wait with it (the subject's order)."""
    due = EPOCH_MS + 1_000
    records = [
        message("early-made", "orders", due),
        encode_message("same-ms", "orders", deliver_at=due + 10, created_at=due + 10),
        message("after", "orders", due + 11),
    ]
    sent, _stats = await sent_at(tmp_path, records, send_interval_ms=0, send_ahead_ms=50)
    assert list(sent) == ["early-made", "same-ms", "after"]
    assert sent["early-made"] == due - 50  # sent ahead
    assert sent["same-ms"] == sent["after"] == due + 10  # at its moment, and the one behind it too


@pytest.mark.parametrize("interval_ms", [0, 20])
async def test_records_realtime_would_not_hold_do_not_hold_up_the_ones_before_them(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, interval_ms: int
) -> None:
    """Every other record of a subject created at its own due time, 20 ms apart: each of
    those leaves at its moment, never before; the others are still sent ahead, none late."""
    due = {f"m{i:03}": EPOCH_MS + 1_000 + 20 * i for i in range(100)}
    records = [
        encode_message(name, "orders", deliver_at=at, created_at=at if i % 2 else EPOCH_MS)
        for i, (name, at) in enumerate(due.items())
    ]
    sent, _stats = await sent_at(tmp_path, records, send_interval_ms=interval_ms, send_ahead_ms=50)
    assert list(sent) == list(due)  # in order, once each
    odd = [name for i, name in enumerate(due) if i % 2]
    assert all(sent[name] >= due[name] for name in odd)  # at their moment, never before
    assert all(sent[name] <= due[name] for name in due if name not in odd)  # the others: ahead, not late
