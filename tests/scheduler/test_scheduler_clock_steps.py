"""Due messages across wall-clock steps.

A message is due when the wall clock reads its ``deliver_at``: after a step back
it waits for the new wall clock to get there (never early by it), after a step
forward what became due goes at once, and a step back that is corrected is
followed within a second. Backoffs are intervals of the monotonic clock, so a
step never stretches them.

Each test runs with a ``TrioClock`` (stepping wakes its sleepers) and with the
production ``SystemClock`` reading a stepped wall clock (its waits must look at
the wall clock again every second), both under ``autojump_clock``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from delaymq.clock import WALL_RECHECK_MS, Clock, SystemClock, TrioClock
from delaymq.protocol.records import encode_message, scan_batch
from delaymq.scheduler.dispatcher import Dispatcher
from delaymq.scheduler.replay import replay_until_caught_up
from delaymq.scheduler.wheelset import WheelSet
from delaymq.storage.threads import run_inline

EPOCH_MS = 1_749_996_000_000  # 2025-06-15 14:00 UTC
SECOND = 1_000
MINUTE = 60 * SECOND


class SteppedClocks:
    """The servers' clock, and a way to step its wall reading (trio's clock goes on)."""

    def __init__(self, kind: str) -> None:
        self.source = TrioClock(EPOCH_MS)
        if kind == "trio":
            self.clock: Clock = self.source
        else:
            source = self.source
            self.clock = SystemClock(
                wall_ns=lambda: source.now_ms() * 1_000_000, monotonic_ns=lambda: source.monotonic_ms() * 1_000_000
            )

    def step(self, delta_ms: int) -> None:
        self.source.step(delta_ms)


@pytest.fixture(params=["trio", "system"])
async def clocks(request: pytest.FixtureRequest) -> SteppedClocks:
    """Tests name ``autojump_clock`` too: pytest-trio runs with a clock among the test's arguments."""
    return SteppedClocks(request.param)


async def step_at(clocks: SteppedClocks, steps: list[tuple[float, int]]) -> None:
    """Step the wall clock by ``delta`` once ``seconds`` of trio's clock went by, for each pair."""
    for seconds, delta in steps:
        await trio.sleep_until(seconds)
        clocks.step(delta)


# -- end to end: scheduler, metaserver, realtime -----------------------------------------


@pytest.mark.parametrize(
    ("steps", "due_in_ms", "wall_received_ms", "trio_received_s"),
    [
        # back ten minutes at +10 s, corrected at +20 s: due at +30 s as planned
        ([(10, -10 * MINUTE), (20, 10 * MINUTE)], 30 * SECOND, 30 * SECOND, 30),
        # back two minutes at +10 s, never corrected: the new wall clock reads +30 s two minutes later
        ([(10, -2 * MINUTE)], 30 * SECOND, 30 * SECOND, 150),
        # forward two hours at +10 s: the message due in an hour goes at once
        ([(10, 2 * 60 * MINUTE)], 60 * MINUTE, 2 * 60 * MINUTE + 10 * SECOND, 10),
    ],
    ids=["back-then-corrected", "back", "forward"],
)
async def test_a_due_message_follows_the_wall_clock_across_steps(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, clocks: SteppedClocks,
    steps: list[tuple[float, int]], due_in_ms: int, wall_received_ms: int, trio_received_s: float,
) -> None:  # fmt: skip
    start = trio.current_time()
    async with sched.open_cluster(tmp_path, clock=clocks.clock) as cluster, cluster.scheduler() as scheduler:
        due = EPOCH_MS + due_in_ms
        await cluster.schedule_raw([sched.message("m", due)])
        receiver = cluster.receiver()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(step_at, clocks, [(start + at, delta) for at, delta in steps])
            with trio.fail_after(3 * 60 * 60):
                (got,) = await receiver.wait_for(1)
            nursery.cancel_scope.cancel()
        assert got.received_at >= due  # never early by the wall clock
        assert 0 <= got.received_at - (EPOCH_MS + wall_received_ms) <= WALL_RECHECK_MS  # within a second
        assert trio.current_time() - start == pytest.approx(trio_received_s, abs=WALL_RECHECK_MS / 1000)
        assert scheduler.registration is not None  # it kept heartbeating through the steps
        assert scheduler.registration.registered and scheduler.registration.statistics().failures == 0


async def test_a_message_scheduled_after_a_step_back_is_due_by_the_new_wall_clock(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, clocks: SteppedClocks
) -> None:
    """Its second is behind seconds the wheel already fired before the step."""
    async with sched.open_cluster(tmp_path, clock=clocks.clock) as cluster, cluster.scheduler():
        clock = clocks.clock
        receiver = cluster.receiver()
        await cluster.schedule_raw([sched.message("before", EPOCH_MS + 8 * SECOND)])
        await receiver.wait_for(1)
        await clock.sleep_until_ms(EPOCH_MS + 10 * SECOND)
        clocks.step(-10 * MINUTE)
        due = clock.now_ms() + 5 * SECOND
        await cluster.schedule_raw([sched.message("after", due)])
        with trio.fail_after(60):
            got = await receiver.wait_for(2)
        assert got[1].id == "after"
        assert 0 <= got[1].received_at - due <= 5  # at its millisecond, as any message


# -- the dispatcher's lanes -------------------------------------------------------------


class FlakyRealtime:
    """A ``deliver`` that fails while ``down``; records the wall time of each message taken."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.down = True
        self.got: list[tuple[str, int]] = []
        self.arrived = trio.Event()
        self.attempts = 0

    async def deliver(self, subject: str, body: bytes) -> list[str]:
        self.attempts += 1
        if self.down:
            raise ConnectionError("realtime is down")
        ids = scan_batch(body).ids
        self.got.extend((name, self.clock.now_ms()) for name in ids)
        self.arrived.set()
        return ["stored"] * len(ids)


DUE = EPOCH_MS + 10 * SECOND


@asynccontextmanager
async def flaky_delivery(sched: SimpleNamespace, tmp_path: Path, clocks: SteppedClocks) -> AsyncIterator[FlakyRealtime]:
    """A dispatcher with one message due at ``DUE``, delivering to a realtime that is down until told otherwise."""
    realtime = FlakyRealtime(clocks.clock)
    with sched.folder(tmp_path, fsync=False) as (log, store):
        log.append(encode_message("m", "s", deliver_at=DUE, created_at=EPOCH_MS))
        log.flush()
        replay_until_caught_up(log, store)
        dispatcher = Dispatcher(
            store=store, wheels=WheelSet(store.undispatched_hours()), deliver=realtime.deliver, clock=clocks.clock,
            run_blocking=run_inline, backoff_ms=100, max_backoff_ms=5_000,
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            await nursery.start(dispatcher.run)
            yield realtime
            nursery.cancel_scope.cancel()


async def test_a_step_back_does_not_stretch_a_delivery_backoff(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, clocks: SteppedClocks
) -> None:
    async with flaky_delivery(sched, tmp_path, clocks) as realtime:
        await trio.sleep(5 * MINUTE / SECOND)  # due long ago; realtime down all along, backoff at its cap
        assert realtime.attempts > 10 and not realtime.got
        clocks.step(-2 * MINUTE)  # still past due by the new wall clock
        await trio.sleep(1)
        realtime.down = False
        back = trio.current_time()
        with trio.fail_after(60):
            await realtime.arrived.wait()
        assert trio.current_time() - back <= 5.0  # within the capped backoff, not two minutes


async def test_a_message_waiting_for_a_retry_is_not_sent_before_its_time_after_a_step_back(
    sched: SimpleNamespace, tmp_path: Path, autojump_clock: trio.testing.MockClock, clocks: SteppedClocks
) -> None:
    async with flaky_delivery(sched, tmp_path, clocks) as realtime:
        await trio.sleep(11)  # fired at +10 s; realtime refused it
        assert realtime.attempts >= 1 and not realtime.got
        clocks.step(-10 * MINUTE)  # its moment is ten minutes away again by the wall clock
        realtime.down = False
        with trio.fail_after(11 * 60):
            await realtime.arrived.wait()
        ((name, at),) = realtime.got
        assert DUE <= at <= DUE + WALL_RECHECK_MS
