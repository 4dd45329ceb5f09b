"""100,000 messages in one second: all fire, in order, each once."""

import random

from delaymq.wheel import HOUR_MS, SecondWheel, Tick

HOUR = 490_000
START = HOUR * HOUR_MS
N = 100_000


def test_a_hundred_thousand_entries_in_one_second_fire_in_order():
    rng = random.Random(7)
    entries = [(42_000 + rng.randrange(1000), e) for e in range(N)]
    rng.shuffle(entries)
    counts = [0] * 3600
    counts[42] = N
    wheel = SecondWheel.from_counts(HOUR, counts)
    wheel.load_second(42, entries)
    fired: list[tuple[int, int]] = []
    confirmed = 0
    now = START + 41_990
    while wheel.next_due_ms() is not None:
        now += rng.randrange(1, 40)
        batch = wheel.pop_due(now)
        assert all(at <= now for at, _ in batch)
        fired.extend(batch)
        confirmed += wheel.mark_done_many(batch[: len(batch) // 2])
    assert fired == sorted((START + ms, e) for ms, e in entries)
    assert wheel.pending().in_flight == N - confirmed
    assert wheel.mark_done_many(fired) == N - confirmed
    assert wheel.is_done()
    assert wheel.tick() == Tick(HOUR * 3600 + 3599, 0, N)


def test_a_hundred_thousand_arrivals_linked_into_a_loaded_second_fire_in_order():
    rng = random.Random(8)
    wheel = SecondWheel(HOUR)
    wheel.load_second(7, [])
    ms_values = [7_000 + rng.randrange(1000) for _ in range(N)]
    for e, ms in enumerate(ms_values):
        wheel.link(7, ms, e)
    fired = wheel.pop_due(START + 7_500) + wheel.pop_due(START + 8_000)
    assert fired == sorted((START + ms, e) for e, ms in enumerate(ms_values))
