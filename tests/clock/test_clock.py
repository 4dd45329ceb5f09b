"""The one clock: epoch time from trio's clock in tests, the wall clock in servers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import trio
import trio.testing
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.clock import STEP_WARN_MS, WALL_RECHECK_MS, AheadClock, Clock, StepWatch, SystemClock, TrioClock

EPOCH = 1_795_000_000_000  # 2026-11-18T...Z
TWO_YEARS_MS = 2 * 366 * 86_400_000


async def test_trio_clock_maps_trio_time_onto_the_epoch(autojump_clock: trio.testing.MockClock) -> None:
    clock = TrioClock(EPOCH)
    assert isinstance(clock, Clock)
    assert clock.now_ms() == EPOCH
    await trio.sleep(1.5)
    assert clock.now_ms() == EPOCH + 1500


async def test_a_two_year_sleep_wakes_on_its_millisecond(autojump_clock: trio.testing.MockClock) -> None:
    clock = TrioClock(EPOCH)
    target = EPOCH + TWO_YEARS_MS - 1
    await clock.sleep_until_ms(target)
    assert clock.now_ms() == target


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=TWO_YEARS_MS), min_size=1, max_size=20))
def test_sleep_until_is_never_early_and_never_a_millisecond_late(offsets: list[int]) -> None:
    woke: list[tuple[int, int]] = []

    async def main() -> None:
        clock = TrioClock(EPOCH)
        for offset in sorted(offsets):
            await clock.sleep_until_ms(EPOCH + offset)
            woke.append((EPOCH + offset, clock.now_ms()))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(target == now for target, now in woke)


async def test_an_ahead_clock_reads_moments_early_and_keeps_intervals(autojump_clock: trio.testing.MockClock) -> None:
    wall = TrioClock(EPOCH)
    ahead = AheadClock(wall, 50)
    assert isinstance(ahead, Clock)
    assert ahead.now_ms() == EPOCH + 50 and ahead.monotonic_ms() == wall.monotonic_ms()
    await ahead.sleep_until_ms(EPOCH + 1_000)  # a moment: reached 50 ms early by the wall clock
    assert wall.now_ms() == EPOCH + 950 and ahead.now_ms() == EPOCH + 1_000
    await ahead.sleep_ms(100)  # an interval: as long as on the wall clock
    assert wall.now_ms() == EPOCH + 1_050
    wall.step(-10_000)  # a step back of the wall clock moves it too
    assert ahead.now_ms() == EPOCH + 1_100 - 10_000
    with pytest.raises(ValueError, match="ahead_ms must be at least 0, got -1"):
        AheadClock(wall, -1)


async def test_sleeping_until_the_past_returns_at_once(autojump_clock: trio.testing.MockClock) -> None:
    clock = TrioClock(EPOCH)
    await trio.sleep(10)
    before = trio.current_time()
    await clock.sleep_until_ms(EPOCH)
    assert trio.current_time() == before


def test_system_clock_reads_the_wall_clock_in_epoch_ms() -> None:
    with freeze_time("2026-12-24T18:00:00Z") as frozen:
        clock = SystemClock()
        assert clock.now_ms() == 1_798_135_200_000
        frozen.tick(90)
        assert clock.now_ms() == 1_798_135_290_000


async def test_system_clock_never_wakes_early() -> None:
    clock = SystemClock()
    for delay in (0, 1, 7, 20):
        target = clock.now_ms() + delay
        await clock.sleep_until_ms(target)
        assert clock.now_ms() >= target


# -- wall-clock steps -----------------------------------------------------------

MINUTE_MS = 60_000


class SteppedWall:
    """A wall clock for ``SystemClock`` that follows trio's clock, plus steps."""

    def __init__(self, epoch_ms: int) -> None:
        self.offset_ns = epoch_ms * 1_000_000 - self.monotonic_ns()

    def monotonic_ns(self) -> int:
        return round(trio.current_time() * 1e9)

    def wall_ns(self) -> int:
        return self.monotonic_ns() + self.offset_ns

    def step(self, delta_ms: int) -> None:
        self.offset_ns += delta_ms * 1_000_000


def stepped_system_clock(epoch_ms: int) -> tuple[SystemClock, SteppedWall]:
    wall = SteppedWall(epoch_ms)
    return SystemClock(wall_ns=wall.wall_ns, monotonic_ns=wall.monotonic_ns), wall


@dataclass
class Stepping:
    """A clock at ``EPOCH``, and how to step its wall reading (trio's clock goes on)."""

    clock: Clock
    step: Callable[[int], None]


@pytest.fixture(params=["trio", "system"])
async def stepping(request: pytest.FixtureRequest) -> Stepping:
    """A ``TrioClock``, or a ``SystemClock`` on a ``SteppedWall``. Tests name ``autojump_clock`` too: pytest-trio
    runs with a clock among the test's arguments."""
    if request.param == "trio":
        clock = TrioClock(EPOCH)
        return Stepping(clock, clock.step)
    system, wall = stepped_system_clock(EPOCH)
    return Stepping(system, wall.step)


def step_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "stepped" in r.getMessage()]


async def test_trio_clock_step_moves_the_wall_reading_not_the_monotonic_one(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    clock = TrioClock(EPOCH)
    await trio.sleep(2)
    mono = clock.monotonic_ms()
    clock.step(-10 * MINUTE_MS)
    assert clock.now_ms() == EPOCH + 2_000 - 10 * MINUTE_MS
    assert clock.monotonic_ms() == mono
    await clock.sleep_ms(1_500)
    assert clock.monotonic_ms() == mono + 1_500
    assert clock.now_ms() == EPOCH + 3_500 - 10 * MINUTE_MS
    assert step_warnings(caplog) == [
        "the wall clock stepped back by 600.0 s; waits for a moment follow the new "
        "wall clock (a message is never delivered before its deliver_at by it), "
        "intervals are not affected"
    ]


@asynccontextmanager
async def waiting_until(clock: Clock, target: int) -> AsyncIterator[list[int]]:
    """A task sleeping until the wall moment ``target``; yields the list it puts the reading it woke at in.

    The block ends once the task woke.
    """
    woke: list[int] = []

    async def wait(*, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        await clock.sleep_until_ms(target)
        woke.append(clock.now_ms())

    async with trio.open_nursery() as nursery:
        await nursery.start(wait)
        yield woke


async def test_a_wall_moment_wait_follows_a_step_back_and_its_correction(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, stepping: Stepping
) -> None:
    target = EPOCH + 10_000
    async with waiting_until(stepping.clock, target) as woke:
        await trio.sleep(5)
        stepping.step(-10 * MINUTE_MS)  # the wall clock goes back ten minutes...
        await trio.sleep(20)
        assert woke == []  # ...so the moment has not come by it, though 25 s went by
        stepping.step(10 * MINUTE_MS)  # corrected: now 25 s past the start, 15 s past the target
        corrected = trio.current_time()
    assert woke and woke[0] >= target
    assert trio.current_time() - corrected <= WALL_RECHECK_MS / 1000
    stepping.clock.now_ms()
    assert len(step_warnings(caplog)) == 2  # each step once


async def test_a_wall_moment_wait_after_a_step_back_ends_when_the_new_wall_clock_reads_it(
    autojump_clock: trio.testing.MockClock, stepping: Stepping
) -> None:
    target = EPOCH + 10_000
    async with waiting_until(stepping.clock, target) as woke:
        await trio.sleep(5)
        stepping.step(-2 * MINUTE_MS)
    assert woke[0] >= target  # never early by the wall clock
    assert woke[0] - target <= 1
    assert trio.current_time() == pytest.approx(5 + 120 + 5, abs=0.01)


async def test_a_step_forward_wakes_a_wall_moment_wait_within_a_second(
    autojump_clock: trio.testing.MockClock, stepping: Stepping
) -> None:
    async with waiting_until(stepping.clock, EPOCH + 30 * MINUTE_MS) as woke:
        await trio.sleep(3)
        stepping.step(45 * MINUTE_MS)
        stepped = trio.current_time()
    assert woke[0] >= EPOCH + 30 * MINUTE_MS
    assert trio.current_time() - stepped <= WALL_RECHECK_MS / 1000


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=0, max_value=60_000),
    st.lists(st.tuples(st.integers(0, 5_000), st.integers(-20 * MINUTE_MS, 20 * MINUTE_MS)), max_size=6),
)
def test_a_system_clock_wait_is_never_early_by_the_wall_clock_however_it_steps(
    offset: int, steps: list[tuple[int, int]]
) -> None:
    woke: list[tuple[int, int]] = []

    async def main() -> None:
        clock, wall = stepped_system_clock(EPOCH)
        target = EPOCH + offset

        async def stepper() -> None:
            for pause, delta in steps:
                await trio.sleep(pause / 1000)
                wall.step(delta)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stepper)
            await clock.sleep_until_ms(target)
            woke.append((target, clock.now_ms()))
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(now >= target for target, now in woke)


def test_step_watch_tells_steps_from_slewing() -> None:
    watch = StepWatch()
    assert watch.observe(EPOCH, 0) == 0
    # NTP slews at most 0.5 ms per second: an hour of it is no step.
    for second in range(1, 3_600):
        assert watch.observe(EPOCH + second * 1_000 + second // 2, second * 1_000) == 0
    assert watch.observe(EPOCH + 3_600_000 - 5_000, 3_600_000) < -STEP_WARN_MS
    assert watch.steps == 1


async def test_a_system_clock_read_many_times_a_millisecond_still_tells_each_step_once(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer reads the clock for each message, many times a millisecond: readings equal to
    the last one seen are not compared again, and a step shows, whole, at the next new reading."""
    clock, wall = stepped_system_clock(EPOCH)
    readings = [clock.now_ms() for _ in range(1_000)]  # trio's clock stands still: one millisecond
    assert set(readings) == {EPOCH}
    wall.step(-10 * MINUTE_MS)
    assert clock.now_ms() == EPOCH - 10 * MINUTE_MS
    for _ in range(3):
        await trio.sleep(0.0004)  # a few readings within the next milliseconds
        clock.now_ms()
    await trio.sleep(5)
    clock.now_ms()
    assert step_warnings(caplog) == [
        "the wall clock stepped back by 600.0 s; waits for a moment follow the new "
        "wall clock (a message is never delivered before its deliver_at by it), "
        "intervals are not affected"
    ]
    assert clock.step_watch.steps == 1
