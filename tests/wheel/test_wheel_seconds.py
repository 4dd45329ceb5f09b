"""SecondWheel: the behaviour a scheduler relies on, case by case."""

import pytest

from delaymq.wheel import HOUR_MS, SecondWheel, Tick, WheelError

HOUR = 472_222  # some hour in 2023
START = HOUR * HOUR_MS


def counts_of(*ms_values: int) -> list[int]:
    counts = [0] * 3600
    for ms in ms_values:
        counts[ms // 1000] += 1
    return counts


def wheel_with(entries: list[tuple[int, int]]) -> SecondWheel:
    """A wheel with every second of ``entries`` (ms_in_hour, entry_no) loaded."""
    wheel = SecondWheel.from_counts(HOUR, counts_of(*(ms for ms, _ in entries)))
    for s in sorted({ms // 1000 for ms, _ in entries}):
        wheel.load_second(s, [(ms, e) for ms, e in entries if ms // 1000 == s])
    return wheel


def delivered_until(now_ms: int, entries: list[tuple[int, int]]) -> SecondWheel:
    """``wheel_with(entries)``, with every entry due by ``now_ms`` fired and marked done."""
    wheel = wheel_with(entries)
    for at, e in wheel.pop_due(now_ms):
        wheel.mark_done(at, e)
    return wheel


def test_empty_wheel_never_wakes_and_is_done():
    wheel = SecondWheel(HOUR)
    assert wheel.next_due_ms() is None
    assert wheel.pop_due(START + HOUR_MS) == []
    assert wheel.is_empty() and wheel.is_done()
    assert wheel.tick() == Tick(HOUR * 3600 + 3599, 0, 0)  # all done, up to 0 entries
    assert wheel.seconds_to_load(START + HOUR_MS) == [] and wheel.next_load_ms() is None


def test_fires_at_its_own_millisecond_in_ms_then_entry_order():
    wheel = wheel_with([(1501, 0), (1500, 3), (1500, 1), (1999, 2)])
    assert wheel.next_due_ms() == START + 1500
    assert wheel.pop_due(START + 1499) == []
    assert wheel.pop_due(START + 1500) == [(START + 1500, 1), (START + 1500, 3)]
    assert wheel.next_due_ms() == START + 1501
    assert wheel.pop_due(START + 5000) == [(START + 1501, 0), (START + 1999, 2)]
    assert wheel.next_due_ms() is None and wheel.is_empty() and not wheel.is_done()


def test_nothing_fires_before_its_hour():
    wheel = wheel_with([(0, 0)])
    assert wheel.pop_due(START - 1) == []
    assert wheel.pop_due(START) == [(START, 0)]


def test_unloaded_seconds_are_counted_then_walked_about_ten_seconds_ahead():
    wheel = SecondWheel.from_counts(HOUR, counts_of(30_500, 30_600, 45_000))
    assert not wheel.is_loaded(30)
    assert wheel.pending().unloaded == 3
    assert wheel.next_load_ms(10_000) == START + 20_000
    assert wheel.seconds_to_load(START + 19_999, 10_000) == []
    assert wheel.seconds_to_load(START + 20_000, 10_000) == [30]
    assert wheel.seconds_to_load(START + 40_000, 10_000) == [30, 45]
    # Before the walk, the earliest possible moment is the second's start: "load it".
    assert wheel.next_due_ms() == START + 30_000
    wheel.note_arrival(30)  # filed while unloaded: only counted
    assert wheel.count(30) == 3
    wheel.load_second(30, [(30_600, 1), (30_001, 3), (30_500, 0)])
    assert wheel.is_loaded(30)
    assert wheel.next_due_ms() == START + 30_001
    assert wheel.pending().scheduled == 3 and wheel.pending().unloaded == 1


def test_a_due_unloaded_second_holds_back_later_seconds():
    wheel = SecondWheel.from_counts(HOUR, counts_of(2_100, 3_100))
    wheel.load_second(3, [(3_100, 1)])
    assert wheel.pop_due(START + 3_500) == []  # second 2 is not walked yet
    assert wheel.next_due_ms() == START + 2_000
    assert wheel.seconds_to_load(START + 3_500, 0) == [2]
    wheel.load_second(2, [(2_100, 0)])
    assert wheel.pop_due(START + 3_500) == [(START + 2_100, 0), (START + 3_100, 1)]


def test_late_link_behind_the_position_fires_at_the_next_pop():
    wheel = wheel_with([(1_200, 0), (1_800, 1)])
    assert wheel.pop_due(START + 1_500) == [(START + 1_200, 0)]
    wheel.link(1, 1_100, 2)  # its millisecond has passed
    wheel.link(1, 1_200, 3)  # same millisecond as one already handed out
    wheel.link(1, 1_600, 4)  # still ahead: waits for its millisecond
    assert wheel.next_due_ms() == START + 1_100
    assert wheel.pop_due(START + 1_500) == [(START + 1_100, 2), (START + 1_200, 3)]
    assert wheel.next_due_ms() == START + 1_600
    assert wheel.pop_due(START + 1_700) == [(START + 1_600, 4)]
    assert wheel.pop_due(START + 1_800) == [(START + 1_800, 1)]


def test_link_into_a_fully_confirmed_second_still_fires():
    wheel = wheel_with([(7_000, 0)])
    assert wheel.pop_due(START + 8_000) == [(START + 7_000, 0)]
    assert wheel.mark_done(START + 7_000, 0)
    assert wheel.is_done()
    wheel.link(7, 7_000, 1)
    assert wheel.pop_due(START + 8_000) == [(START + 7_000, 1)]


def test_a_confirmation_for_another_time_is_refused_and_leaves_the_entry_in_flight():
    wheel = wheel_with([(5_100, 0), (5_200, 1)])
    wheel.pop_due(START + 6_000)
    with pytest.raises(WheelError, match="entry_no=1.*handed out for"):
        wheel.mark_done_many([(START + 5_100, 0), (START + 5_100, 1)])
    assert wheel.pending().in_flight == 1  # entry 0 was marked, entry 1 was not
    assert not wheel.mark_done(START + 5_100, 0)
    assert wheel.mark_done(START + 5_200, 1)
    assert wheel.is_done()


def test_tick_is_the_confirmed_prefix_in_firing_order():
    wheel = wheel_with([(5_100, 0), (5_200, 1), (5_300, 2), (9_000, 3)])
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 0, 4)
    fired = wheel.pop_due(START + 10_000)
    assert [e for _, e in fired] == [0, 1, 2, 3]
    assert wheel.pending().in_flight == 4
    assert wheel.mark_done(START + 5_200, 1)  # out of order: prefix unchanged
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 0, 4)
    assert wheel.mark_done(START + 5_100, 0)
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 2, 4)
    assert wheel.mark_done_many([(START + 5_300, 2), (START + 5_300, 2)]) == 1
    assert wheel.tick() == Tick(HOUR * 3600 + 9, 0, 4)
    assert not wheel.mark_done(START + 5_300, 2)  # already confirmed
    assert wheel.mark_done(START + 9_000, 3)
    assert wheel.is_done() and wheel.tick() == Tick(HOUR * 3600 + 3599, 0, 4)


def test_tick_moves_back_for_a_late_link_until_it_is_confirmed():
    wheel = delivered_until(START + 5_600, [(5_100, 0), (5_500, 1)])
    assert wheel.tick() == Tick(HOUR * 3600 + 3599, 0, 2)
    wheel.link(5, 5_300, 2)
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 0, 3)  # second freed: claims less, safely
    wheel2 = delivered_until(START + 5_600, [(5_100, 0), (5_500, 1), (6_000, 2)])
    assert wheel2.tick() == Tick(HOUR * 3600 + 6, 0, 3)
    wheel2.link(5, 5_300, 3)
    assert wheel2.tick() == Tick(HOUR * 3600 + 5, 0, 4)
    [(at, e)] = wheel2.pop_due(START + 5_600)
    assert (at, e) == (START + 5_300, 3)
    wheel2.mark_done(at, e)
    assert wheel2.tick() == Tick(HOUR * 3600 + 6, 0, 4)


def test_tick_moves_back_exactly_inside_a_second_still_in_memory():
    wheel = delivered_until(START + 5_600, [(5_100, 0), (5_500, 1), (5_900, 2)])
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 2, 3)
    wheel.link(5, 5_300, 3)
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 1, 4)


def test_skip_to_a_tick_fires_only_the_rest():
    entries = [(5_100, 0), (5_100, 4), (5_500, 1), (5_900, 2), (3_000, 3)]
    wheel = SecondWheel.from_counts(HOUR, counts_of(*(ms for ms, _ in entries)))
    wheel.skip_to(Tick(HOUR * 3600 + 5, 2, 5))  # second 3 done; (5100,0), (5100,4) done
    assert wheel.seconds_to_load(START, 10_000) == [5]  # second 3 needs no walk
    wheel.load_second(5, [(ms, e) for ms, e in entries if ms // 1000 == 5])
    assert wheel.tick() == Tick(HOUR * 3600 + 5, 2, 5)
    assert wheel.pop_due(START + 10_000) == [(START + 5_500, 1), (START + 5_900, 2)]


def test_skip_to_respects_the_tick_limit_for_entries_filed_after_it():
    # The master knew entries 0..2; entry 3 (filed later, sorting first) is not covered.
    entries = [(1_000, 3), (2_100, 0), (2_200, 1), (2_050, 4), (2_900, 2)]
    wheel = SecondWheel.from_counts(HOUR, counts_of(*(ms for ms, _ in entries)))
    wheel.skip_to(Tick(HOUR * 3600 + 2, 2, 3))
    assert wheel.walk_floor(1) == 3 and wheel.walk_floor(2) == 0
    assert wheel.seconds_to_load(START, 10_000) == [1, 2]
    wheel.load_second(1, [(1_000, 3)])
    wheel.load_second(2, [(ms, e) for ms, e in entries if ms // 1000 == 2])
    fired = wheel.pop_due(START + 10_000)
    assert fired == [(START + 1_000, 3), (START + 2_050, 4), (START + 2_900, 2)]


def test_skip_to_ignores_done_when_this_index_lags_the_master():
    # The slave knows 2 entries, the master's tick covered 3: its "done" is unusable.
    wheel = SecondWheel.from_counts(HOUR, counts_of(2_100, 2_200))
    wheel.skip_to(Tick(HOUR * 3600 + 2, 2, 3))
    wheel.load_second(2, [(2_200, 1), (2_100, 0)])
    assert [e for _, e in wheel.pop_due(START + 3_000)] == [0, 1]


def test_a_done_hour_tick_does_not_cover_entries_filed_after_it():
    master = delivered_until(START + HOUR_MS, [(100, 0), (3_599_100, 1)])
    tick = master.tick()
    assert tick == Tick(HOUR * 3600 + 3599, 1, 2)
    slave = SecondWheel.from_counts(HOUR, counts_of(100, 3_599_100, 3_599_000, 50))
    slave.skip_to(tick)
    assert slave.seconds_to_load(START + HOUR_MS) == [0, 3599]
    slave.load_second(0, [(50, 3)])  # walked down to walk_floor(0) == 2
    slave.load_second(3599, [(3_599_000, 2), (3_599_100, 1)])
    assert slave.pop_due(START + HOUR_MS) == [(START + 50, 3), (START + 3_599_000, 2)]


def test_skip_to_other_hours():
    before = SecondWheel.from_counts(HOUR, counts_of(100))
    before.skip_to(Tick(HOUR * 3600 - 1, 5))
    assert before.seconds_to_load(START) == [0]
    after = SecondWheel.from_counts(HOUR, counts_of(100, 3_599_999))
    after.skip_to(Tick.start_of(HOUR + 1))
    assert after.is_done() and after.seconds_to_load(START + HOUR_MS) == []
    assert after.next_due_ms() is None


def test_dispatch_logged_entries_are_skipped_on_load():
    wheel = SecondWheel.from_counts(HOUR, counts_of(4_100, 4_200, 4_300))
    wheel.mark_delivered({0, 2})
    wheel.load_second(4, [(4_300, 2), (4_200, 1), (4_100, 0)])
    assert wheel.pending().scheduled == 1
    assert wheel.tick() == Tick(HOUR * 3600 + 4, 1, 3)
    assert wheel.pop_due(START + 5_000) == [(START + 4_200, 1)]


def test_the_delivered_set_lets_go_of_entries_once_their_second_is_loaded():
    wheel = SecondWheel.from_counts(HOUR, counts_of(4_100, 5_100, 5_200))
    wheel.mark_delivered({0, 2})
    assert set(wheel.delivered()) == {0, 2}  # the scheduler skips reading their records
    wheel.load_second(4, [(4_100, 0)])
    assert set(wheel.delivered()) == {2}
    wheel.load_second(5, [(5_200, 2), (5_100, 1)])
    assert not wheel.delivered()


def test_skip_to_after_loading_is_refused():
    wheel = wheel_with([(100, 0)])
    with pytest.raises(WheelError, match="skip_to"):
        wheel.skip_to(Tick(HOUR * 3600))


def test_inconsistent_input_is_refused_naming_the_field():
    wheel = SecondWheel.from_counts(HOUR, counts_of(1_100, 1_200))
    with pytest.raises(WheelError, match="1 entries given, the wheel counts 2"):
        wheel.load_second(1, [(1_100, 0)])
    with pytest.raises(WheelError, match="ms_in_hour=2100"):
        wheel.load_second(1, [(1_100, 0), (2_100, 1)])
    with pytest.raises(WheelError, match="entry_no=-1"):
        wheel.load_second(1, [(1_100, 0), (1_200, -1)])
    with pytest.raises(WheelError, match="link.*not loaded"):
        wheel.link(1, 1_300, 2)
    wheel.load_second(1, [(1_100, 0), (1_200, 1)])
    with pytest.raises(WheelError, match="already loaded"):
        wheel.load_second(1, [])
    with pytest.raises(WheelError, match="note_arrival.*loaded"):
        wheel.note_arrival(1)
    with pytest.raises(WheelError, match="entry_no=1 is already linked"):
        wheel.link(1, 1_200, 1)
    with pytest.raises(WheelError, match="ms_in_hour=999"):
        wheel.link(1, 999, 2)
    with pytest.raises(WheelError, match="second=3600"):
        wheel.note_arrival(3600)
    with pytest.raises(WheelError, match="counts: 3599 given"):
        SecondWheel.from_counts(HOUR, [0] * 3599)
    [(at, e)] = wheel.pop_due(START + 1_100)
    with pytest.raises(WheelError, match="deliver_at_ms"):
        wheel.mark_done(at + 1, e)


def test_an_empty_second_can_be_loaded_ahead_so_arrivals_link_directly():
    wheel = SecondWheel(HOUR)
    wheel.load_second(10, [])
    wheel.link(10, 10_500, 0)
    assert wheel.next_due_ms() == START + 10_500
    assert wheel.pop_due(START + 10_500) == [(START + 10_500, 0)]


def test_a_batch_of_arrivals_leaves_the_wheel_as_arriving_one_by_one_would():
    """``arrive_many`` counts a batch's unloaded seconds per second and links the rest in entry
    order; the wheel must come out as from ``note_arrival`` and ``link`` one at a time."""
    ms_values = [(s * 1000 + (e * 37) % 1000) for e, s in enumerate([12, 10, 11, 12, 40, 10, 41, 12, 40, 11] * 30)]

    def fed(batch: bool) -> SecondWheel:
        wheel = SecondWheel(HOUR)
        wheel.load_second(10, [])
        wheel.load_second(12, [])
        if batch:
            assert wheel.arrive_many(0, ms_values) == [e for e, ms in enumerate(ms_values) if ms // 1000 in (10, 12)]
        else:
            for e, ms in enumerate(ms_values):
                if wheel.is_loaded(ms // 1000):
                    wheel.link(ms // 1000, ms, e)
                else:
                    wheel.note_arrival(ms // 1000)
        return wheel

    batch, single = fed(True), fed(False)
    assert batch.pending() == single.pending()
    assert [batch.count(s) for s in range(3600)] == [single.count(s) for s in range(3600)]
    assert batch.next_due_ms() == single.next_due_ms() == START + min(ms for ms in ms_values if ms // 1000 == 10)
    assert (
        batch.seconds_to_load(START + 45_000, 10_000) == single.seconds_to_load(START + 45_000, 10_000) == [11, 40, 41]
    )
    assert batch.pop_due(START + 13_000) == single.pop_due(START + 13_000)
