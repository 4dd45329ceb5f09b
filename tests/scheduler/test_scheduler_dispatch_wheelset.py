"""The dispatcher's pure rules (``WheelSet``): what to open, load and fire, without any I/O.

Each test plays the dispatcher's part by hand: it "reads" heads and chains from a small
in-memory model of an hour's entries.
"""

from __future__ import annotations

import pytest

from delaymq.scheduler.wheelset import Load, WheelSet
from delaymq.wheel import HOUR_MS, SECONDS_PER_HOUR, Tick, WheelError

H = 486_110  # 2025-06-15 14:00 UTC
START = H * HOUR_MS


class Model:
    """The entries filed into each hour, as replay would number them."""

    def __init__(self) -> None:
        self.ms: dict[int, list[int]] = {}

    def file(self, hour: int, *ms_in_hour: int) -> tuple[int, list[int]]:
        entries = self.ms.setdefault(hour, [])
        first = len(entries)
        entries.extend(ms_in_hour)
        return first, list(ms_in_hour)

    def heads(self, hour: int) -> tuple[list[int], int]:
        counts = [0] * SECONDS_PER_HOUR
        for ms in self.ms.get(hour, []):
            counts[ms // 1000] += 1
        return counts, len(self.ms.get(hour, []))

    def chain(self, load: Load) -> list[tuple[int, int]]:
        return [
            (ms, n)
            for n, ms in enumerate(self.ms[load.hour])
            if ms // 1000 == load.second and load.floor <= n < load.below
        ]


def open_all(wheels: WheelSet, model: Model, now: int, delivered: dict[int, set[int]] | None = None) -> list[int]:
    opened = wheels.hours_to_open(now)
    for hour in opened:
        wheels.begin_open(hour)
        counts, known = model.heads(hour)
        wheels.opened(hour, counts, known, (delivered or {}).get(hour, set()))
    return opened


def load_all(wheels: WheelSet, model: Model, now: int) -> list[Load]:
    loads = wheels.seconds_to_load(now)
    wheels.begin_load(loads)
    for load in loads:
        wheels.loaded(load, model.chain(load))
    return loads


def fire(wheels: WheelSet, now: int) -> list[tuple[int, int, int]]:
    """Pop what is due and confirm it at once: (hour, deliver_at, entry)."""
    out = []
    for hour, items in wheels.pop_due(now):
        wheels.confirm(hour, items)
        out.extend((hour, at, entry) for at, entry in items)
    return out


def test_overdue_hours_open_oldest_first_within_the_window_then_the_current_and_next_hour() -> None:
    model = Model()
    hours = [H - 30, H - 20, H - 10, H, H + 1, H + 5]
    for hour in hours:
        model.file(hour, 1_000)
    wheels = WheelSet(hours, max_open_hours=2, hour_preload_ms=60_000)
    now = START + 100
    assert wheels.hours_to_open(now) == [H - 30, H - 20]
    seen = []
    while len(seen) < 4:
        opened = open_all(wheels, model, now)
        seen += opened
        load_all(wheels, model, now)
        assert fire(wheels, now)  # the overdue ones go at once
        for hour in wheels.hours_to_close(now):
            wheels.close(hour)
    assert seen == [H - 30, H - 20, H - 10, H]
    assert wheels.hours_to_open(now) == []  # the next hour waits for its preload moment
    assert wheels.next_load_ms(now) == START + HOUR_MS - 60_000
    assert wheels.next_due_ms() == START + 1_000
    assert wheels.hours_to_open(START + HOUR_MS - 60_000) == [H + 1]
    assert wheels.hours() == [H, H + 1, H + 5]


def test_pop_due_hands_out_in_millisecond_order_and_never_anything_later() -> None:
    model = Model()
    model.file(H, 5_002, 5_000, 5_001, 5_000, 9_999)
    wheels = WheelSet([H], load_ahead_ms=10_000)
    open_all(wheels, model, START)
    load_all(wheels, model, START)
    assert wheels.next_due_ms() == START + 5_000
    assert fire(wheels, START + 4_999) == []
    assert fire(wheels, START + 5_000) == [(H, START + 5_000, 1), (H, START + 5_000, 3)]
    assert fire(wheels, START + 5_001) == [(H, START + 5_001, 2)]
    assert wheels.next_due_ms() == START + 5_002


def test_an_earlier_hour_with_a_due_second_still_unloaded_holds_back_later_hours() -> None:
    model = Model()
    model.file(H - 2, 3_000_000)
    model.file(H - 1, 10)
    wheels = WheelSet([H - 2, H - 1], load_ahead_ms=0)
    now = START
    open_all(wheels, model, now)
    # Only the later hour's second gets loaded: the earlier one is still unloaded.
    load = next(load for load in wheels.seconds_to_load(now) if load.hour == H - 1)
    wheels.begin_load([load])
    wheels.loaded(load, model.chain(load))
    assert fire(wheels, now) == []  # H-2 comes first
    assert wheels.next_due_ms() == (H - 2) * HOUR_MS + 3_000_000  # "load it now"
    load_all(wheels, model, now)
    assert [hour for hour, _at, _e in fire(wheels, now)] == [H - 2, H - 1]


def test_arrivals_during_a_heads_read_wait_and_skip_what_the_read_saw() -> None:
    model = Model()
    model.file(H, 2_000)
    wheels = WheelSet([H])
    wheels.begin_open(H)
    first, ms = model.file(H, 2_500)  # filed while the heads are read...
    counts, known = model.heads(H)  # ...and seen by the read
    wheels.arrive(H, first, ms)
    later = model.file(H, 2_700)  # filed after the read
    wheels.arrive(H, *later)
    assert wheels.counts().buffered == 2
    wheels.opened(H, counts, known, set())
    assert wheels.wheel(H).pending().known == 3  # nothing counted twice, nothing lost
    load_all(wheels, model, START)
    assert [e for _h, _at, e in fire(wheels, START + 3_000)] == [0, 1, 2]


def test_arrivals_during_a_chain_walk_wait_then_link_or_count() -> None:
    model = Model()
    model.file(H, 1_000, 4_000)
    wheels = WheelSet([H], load_ahead_ms=2_000)
    open_all(wheels, model, START)
    loads = wheels.seconds_to_load(START)
    assert [load.second for load in loads] == [1]
    wheels.begin_load(loads)
    wheels.arrive(H, *model.file(H, 1_500, 4_100))  # a loaded second and an unloaded one
    with pytest.raises(WheelError):
        wheels.close(H)
    wheels.loaded(loads[0], model.chain(loads[0]))
    wheel = wheels.wheel(H)
    assert wheel.count(1) == 2 and wheel.count(4) == 2
    assert wheel.pending().scheduled == 2 and wheel.pending().unloaded == 2
    assert [e for _h, _at, e in fire(wheels, START + 1_500)] == [0, 2]


def test_arrivals_linked_into_loaded_seconds_are_listed_once_for_reading() -> None:
    model = Model()
    model.file(H, 1_000, 4_000)
    wheels = WheelSet([H], load_ahead_ms=2_000)
    open_all(wheels, model, START)
    loads = wheels.seconds_to_load(START)
    wheels.begin_load(loads)  # second 1 is walked ...
    wheels.arrive(H, *model.file(H, 1_500, 4_100))  # ... while these arrive (buffered)
    assert wheels.take_linked() == {}
    wheels.loaded(loads[0], model.chain(loads[0]))
    wheels.arrive(H, *model.file(H, 1_700, 4_200))
    # Linked into the loaded second 1 (the walk saw neither); second 4 is counted, read with its walk.
    assert wheels.take_linked() == {H: [2, 4]}
    assert wheels.take_linked() == {}
    assert [e for _h, _at, e in fire(wheels, START + 2_000)] == [0, 2, 4]


def test_an_arrival_behind_the_firing_position_fires_at_once() -> None:
    model = Model()
    model.file(H, 1_000)
    wheels = WheelSet([H])
    open_all(wheels, model, START)
    load_all(wheels, model, START)
    assert len(fire(wheels, START + 1_500)) == 1
    wheels.arrive(H, *model.file(H, 1_200))  # its millisecond is already passed
    assert wheels.next_due_ms() == START + 1_200
    assert fire(wheels, START + 1_501) == [(H, START + 1_200, 1)]


def test_a_finished_hour_closes_after_its_end_and_reopens_for_a_late_arrival() -> None:
    model = Model()
    model.file(H, 3_599_000)
    wheels = WheelSet([H], done_grace_ms=10_000)
    open_all(wheels, model, START)
    load_all(wheels, model, START + 3_599_000)
    fire(wheels, START + 3_599_000)
    end = START + HOUR_MS
    assert wheels.hours_to_close(end) == []  # still the current hour's grace
    assert wheels.next_load_ms(end) == end + 10_000
    assert wheels.hours_to_close(end + 10_000) == [H]
    wheels.close(H)
    assert wheels.hours() == []
    # A message received at 14:59:59.999 and filed after the hour was closed:
    wheels.arrive(H, *model.file(H, 3_599_999))
    assert wheels.hours() == [H] and wheels.hours_to_open(end + 10_001) == [H]
    open_all(wheels, model, end + 10_001, {H: {0}})
    load_all(wheels, model, end + 10_001)
    assert fire(wheels, end + 10_001) == [(H, START + 3_599_999, 1)]  # overdue: at once; entry 0 not again


def test_the_memory_budget_bounds_loading_but_never_blocks_an_earlier_second() -> None:
    model = Model()
    model.file(H, *[s * 1000 for s in range(10, 20) for _ in range(3)])
    wheels = WheelSet([H], max_loaded=5, load_ahead_ms=60_000)
    open_all(wheels, model, START)
    assert [load.second for load in load_all(wheels, model, START)] == [10, 11]  # 6 entries >= 5
    assert wheels.seconds_to_load(START) == []
    assert wheels.short_of_budget  # a confirmation is worth a look ...
    assert wheels.next_load_ms(START) is None  # ... due loads wait for budget, not for time
    wheels.arrive(H, *model.file(H, 5_000))  # an arrival into an empty second before them
    assert [load.second for load in load_all(wheels, model, START)] == [5]
    fired = fire(wheels, START + 11_000)
    assert len(fired) == 7
    assert [load.second for load in load_all(wheels, model, START)] == [12, 13]
    fire(wheels, START + 13_000)
    assert [load.second for load in load_all(wheels, model, START)] == [14, 15]
    assert wheels.short_of_budget
    fire(wheels, START + 15_000)
    assert [load.second for load in load_all(wheels, model, START)] == [16, 17]
    fire(wheels, START + 17_000)
    assert [load.second for load in load_all(wheels, model, START)] == [18, 19]
    assert not wheels.short_of_budget  # every second is loaded: nothing waits for budget


def test_tick_is_the_earliest_unfinished_hour_or_the_current_one() -> None:
    model = Model()
    model.file(H - 1, 7_000, 7_000)
    model.file(H + 2, 0)
    wheels = WheelSet([H - 1, H + 2])
    assert wheels.tick(START) == Tick.start_of(H - 1)  # not open yet: nothing of it is claimed
    open_all(wheels, model, START)
    load_all(wheels, model, START)
    items = wheels.pop_due(START)[0][1]
    wheels.confirm(H - 1, items[:1])
    assert wheels.tick(START) == Tick((H - 1) * 3600 + 7, 1, 2)
    wheels.confirm(H - 1, items[1:])
    assert wheels.tick(START) == Tick.start_of(H)  # the current hour, nothing of it open
    assert wheels.tick(START - HOUR_MS + 8_000).hour == H - 1


def test_settings_are_checked_by_name() -> None:
    with pytest.raises(WheelError, match="max_open_hours=0"):
        WheelSet(max_open_hours=0)
    with pytest.raises(WheelError, match="load_ahead_ms=-1"):
        WheelSet(load_ahead_ms=-1)
