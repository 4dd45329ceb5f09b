"""The one clock: epoch time from trio's clock in tests, the wall clock in servers."""

from __future__ import annotations

import trio
import trio.testing
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.wheel.clock import Clock, SystemClock, TrioClock

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
