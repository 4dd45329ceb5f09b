"""The one backoff policy: exponential growth to a ceiling, jitter below it, a fixed random source in tests."""

from __future__ import annotations

import itertools
import random

import pytest

from delaymq.protocol.backoff import Backoff, BackoffRun


def test_the_ceiling_grows_by_the_multiplier_up_to_the_maximum() -> None:
    policy = Backoff(initial_ms=100, maximum_ms=1_000, multiplier=2.0, jitter="none")
    assert [policy.ceiling_ms(n) for n in range(1, 7)] == [100, 200, 400, 800, 1_000, 1_000]
    assert policy.ceiling_ms(10_000) == 1_000  # no overflow far down a long outage
    slow = Backoff(initial_ms=100, maximum_ms=1_000, multiplier=1.5, jitter="none")
    assert [slow.ceiling_ms(n) for n in range(1, 5)] == [100, 150, 225, 338]  # rounded up
    assert Backoff(initial_ms=250, maximum_ms=250, multiplier=1).ceiling_ms(9) == 250


def test_full_jitter_spreads_over_the_whole_ceiling_equal_over_its_upper_half() -> None:
    full = Backoff(initial_ms=100, maximum_ms=800, jitter="full")
    equal = Backoff(initial_ms=100, maximum_ms=800, jitter="equal")
    assert [full.delay_ms(3, u) for u in (0.0, 0.5, 0.999)] == [0, 200, 399]
    assert [equal.delay_ms(3, u) for u in (0.0, 0.5, 0.999)] == [200, 300, 399]
    assert Backoff(initial_ms=100, jitter="none").delay_ms(2, 0.7) == 200
    with pytest.raises(ValueError, match="u is 1.0, must be in"):
        full.delay_ms(1, 1.0)


def test_a_run_grows_with_each_failure_and_starts_over_on_reset() -> None:
    sources = itertools.cycle([0.0, 0.5])
    run = BackoffRun(Backoff(initial_ms=100, maximum_ms=1_000, jitter="equal"), random=lambda: next(sources))
    assert [run.next_delay_ms() for _ in range(6)] == [50, 150, 200, 600, 500, 750]
    assert run.failures == 6
    run.reset()
    assert run.next_delay_ms() == 50


def test_clients_that_failed_together_come_back_spread_out() -> None:
    policy = Backoff(initial_ms=100, maximum_ms=1_000, jitter="equal")
    rng = random.Random(7)
    waits = [BackoffRun(policy, random=rng.random) for _ in range(50)]
    fourth = [run.next_delay_ms() for run in waits for _ in range(4)][3::4]
    assert all(400 <= wait <= 800 for wait in fourth)  # never less than half the ceiling: no tight loop
    assert len(set(fourth)) > 25  # and not in lockstep


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"initial_ms": -1}, "initial_ms is -1, must be an int of 0 or more"),
        ({"initial_ms": 0.5}, "initial_ms is 0.5"),
        ({"initial_ms": 500, "maximum_ms": 100}, r"maximum_ms \(100\) must be at least initial_ms \(500\)"),
        ({"multiplier": 0.5}, "multiplier is 0.5, must be a finite number of 1 or more"),
        ({"multiplier": float("inf")}, "multiplier is inf"),
        ({"jitter": "decorrelated"}, "jitter is 'decorrelated', must be one of 'full', 'equal', 'none'"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(**options)  # type: ignore[arg-type]
