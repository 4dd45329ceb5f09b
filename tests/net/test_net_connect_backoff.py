"""The connect backoff of a peer pool: jittered under the one policy, never tighter than half its ceiling."""

from __future__ import annotations

import random

import pytest

from delaymq.net.peers import ConnectBackoff

#: ``Peers``' defaults: 0.1 s doubling to 5 s.
CEILINGS_S = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
#: The top of a random source's range [0, 1).
TOP = 1 - 1e-9


def waits_s(backoff: ConnectBackoff, failures: int, address: str = "rt1:20881") -> list[float]:
    """The waits after ``failures`` failed connects in a row, each redial at the moment it is allowed."""
    now = 1_000.0
    waits = []
    for _ in range(failures):
        backoff.failed(address, now)
        at = backoff.retry_at(address)
        assert at is not None
        waits.append(at - now)
        now = at
    return waits


def test_clients_of_a_peer_that_went_down_redial_it_spread_out_never_in_a_tight_loop() -> None:
    rng = random.Random(11)
    clients = [waits_s(ConnectBackoff(0.1, 5.0, random=rng.random), len(CEILINGS_S)) for _ in range(40)]
    for n, ceiling in enumerate(CEILINGS_S):
        nth = [waits[n] for waits in clients]
        assert all(ceiling / 2 - 1e-9 <= wait <= ceiling + 1e-9 for wait in nth), (n, nth)  # the floor, the cap
        assert len({round(wait, 3) for wait in nth}) > 20, (n, nth)  # not in lockstep


def test_the_extremes_of_the_random_source_give_the_floor_and_the_ceiling() -> None:
    floor = waits_s(ConnectBackoff(0.1, 5.0, random=lambda: 0.0), len(CEILINGS_S))
    assert floor == pytest.approx([ceiling / 2 for ceiling in CEILINGS_S])
    top = waits_s(ConnectBackoff(0.1, 5.0, random=lambda: TOP), len(CEILINGS_S))
    assert top == pytest.approx(CEILINGS_S, abs=0.0011)  # within the millisecond the policy rounds down


def test_a_connect_forgets_the_failures_and_other_peers_are_not_affected() -> None:
    backoff = ConnectBackoff(0.1, 5.0, random=lambda: 0.0)
    assert waits_s(backoff, 3) == pytest.approx([0.05, 0.1, 0.2])
    assert backoff.retry_at("rt2:20881") is None
    backoff.connected("rt1:20881")
    assert backoff.retry_at("rt1:20881") is None
    assert waits_s(backoff, 1) == pytest.approx([0.05])  # from the start again


@pytest.mark.parametrize(("initial", "maximum"), [(30.0, 5.0), (-0.1, 5.0), (float("nan"), 5.0)])
def test_a_backoff_whose_initial_wait_exceeds_its_maximum_is_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match=r"connect backoff: initial \(.* s\) must be 0 or more and at most maximum"):
        ConnectBackoff(initial, maximum)
