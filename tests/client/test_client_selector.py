"""The group selector: round robin over available groups, avoidance, exclude, route changes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.client.faults import AvoidancePolicy, LatencyFaultTable
from delaymq.client.selector import GroupSelector, NoGroupError

T0 = 1_700_000_000_000


def picks(selector: GroupSelector, count: int, now_ms: int = T0) -> list[str]:
    return [selector.pick(now_ms) for _ in range(count)]


def test_round_robin_is_fair() -> None:
    selector = GroupSelector(["a", "b", "c"])
    assert picks(selector, 6) == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_stays_fair_around_an_avoided_group() -> None:
    selector = GroupSelector(["a", "b", "c", "d"])
    selector.faults.record_failure("b", T0)
    chosen = picks(selector, 300, T0 + 1)
    assert Counter(chosen) == {"a": 100, "c": 100, "d": 100}
    # Strict alternation, not a group picked twice for the skipped one.
    assert chosen[:6] == ["a", "c", "d", "a", "c", "d"]


def test_failed_group_is_skipped_then_returns_after_its_avoid_period() -> None:
    selector = GroupSelector(["a", "b"])
    selector.faults.record_failure("a", T0)
    assert set(picks(selector, 4, T0 + 1)) == {"b"}
    assert set(picks(selector, 4, T0 + 599_999)) == {"b"}
    assert set(picks(selector, 4, T0 + 600_000)) == {"a", "b"}


def test_slow_group_is_skipped_for_its_latency_step() -> None:
    selector = GroupSelector(["a", "b"])
    selector.faults.record_latency("a", 1_000, T0)  # 60 s
    assert set(picks(selector, 4, T0 + 59_999)) == {"b"}
    assert set(picks(selector, 4, T0 + 60_000)) == {"a", "b"}


def test_all_avoided_picks_the_soonest_available() -> None:
    selector = GroupSelector(["a", "b", "c"])
    selector.faults.record_failure("a", T0)  # until T0 + 600 s
    selector.faults.record_failure("b", T0 + 10)  # until T0 + 600.01 s
    selector.faults.record_latency("c", 3_500, T0 + 20)  # until T0 + 180.02 s
    assert selector.pick(T0 + 30) == "c"
    assert selector.statistics().avoided_picks == 1


def test_all_failed_picks_the_least_recently_failed() -> None:
    selector = GroupSelector(["a", "b", "c"])
    selector.faults.record_failure("b", T0 + 1)
    selector.faults.record_failure("c", T0 + 2)
    selector.faults.record_failure("a", T0 + 3)
    assert picks(selector, 3, T0 + 4) == ["b", "b", "b"]
    # The last resort answers quickly: it is back in the rotation at once.
    selector.faults.record_latency("b", 12, T0 + 5)
    assert selector.pick(T0 + 5) == "b"


def test_send_refused_by_one_group_goes_to_another() -> None:
    selector = GroupSelector(["a", "b", "c"])
    first = selector.pick(T0)
    second = selector.pick(T0, exclude={first})
    third = selector.pick(T0, exclude={first, second})
    assert len({first, second, third}) == 3


def test_exclude_beats_avoidance() -> None:
    """An untried group, even an avoided one, is a better retry than the group that refused."""
    selector = GroupSelector(["a", "b"])
    selector.faults.record_latency("b", 700, T0)
    assert selector.pick(T0 + 1, exclude={"a"}) == "b"


def test_every_group_tried_repeats_one() -> None:
    selector = GroupSelector(["a", "b"])
    selector.faults.record_failure("a", T0)
    assert selector.pick(T0 + 1, exclude={"a", "b"}) == "b"
    assert selector.statistics().repeated_picks == 1


def test_vanished_group_is_dropped_with_its_fault_entry() -> None:
    selector = GroupSelector(["a", "b", "c"])
    selector.faults.record_failure("b", T0)
    selector.update_groups(["a", "c"])
    assert selector.groups == ("a", "c")
    assert "b" not in selector.faults
    assert set(picks(selector, 10, T0 + 1)) == {"a", "c"}
    # If it comes back, it comes back clean.
    selector.update_groups(["a", "b", "c"])
    assert set(picks(selector, 3, T0 + 1)) == {"a", "b", "c"}


def test_new_group_joins_the_rotation() -> None:
    selector = GroupSelector(["a", "b"])
    assert picks(selector, 1) == ["a"]
    selector.update_groups(["a", "b", "c"])
    assert picks(selector, 4) == ["b", "c", "a", "b"]


def test_update_keeps_the_rotation_place() -> None:
    selector = GroupSelector(["a", "b", "c"])
    assert picks(selector, 2) == ["a", "b"]
    selector.update_groups(["x", "c", "a"])  # "c" was due next; it still is
    assert picks(selector, 3) == ["c", "a", "x"]


def test_shared_table_is_not_pruned_by_one_route() -> None:
    table = LatencyFaultTable()
    orders = GroupSelector(["a", "b"], faults=table)
    payments = GroupSelector(["b", "c"], faults=table)
    table.record_failure("b", T0)
    assert set(picks(orders, 4, T0 + 1)) == {"a"}
    assert set(picks(payments, 4, T0 + 1)) == {"c"}
    orders.update_groups(["a"])
    assert not table.is_available("b", T0 + 1)
    assert set(picks(payments, 4, T0 + 1)) == {"c"}


def test_policy_and_shared_table_are_exclusive() -> None:
    with pytest.raises(ValueError, match="policy must not be given with faults"):
        GroupSelector(["a"], faults=LatencyFaultTable(), policy=AvoidancePolicy())


def test_custom_policy_is_used() -> None:
    selector = GroupSelector(["a", "b"], policy=AvoidancePolicy(failure_avoid_ms=5_000))
    selector.faults.record_failure("a", T0)
    assert set(picks(selector, 2, T0 + 4_999)) == {"b"}
    assert set(picks(selector, 2, T0 + 5_000)) == {"a", "b"}


def test_empty_route_raises() -> None:
    selector = GroupSelector()
    with pytest.raises(NoGroupError, match="the route holds 0 groups"):
        selector.pick(T0)


def test_bad_group_name_is_refused() -> None:
    with pytest.raises(ValueError, match="groups entry '' must be a non-empty str"):
        GroupSelector(["a", ""])


def test_duplicate_groups_count_once() -> None:
    selector = GroupSelector(["a", "b", "a"])
    assert selector.groups == ("a", "b")


def test_statistics() -> None:
    selector = GroupSelector(["a", "b"])
    picks(selector, 3)
    stats = selector.statistics()
    assert (stats.groups, stats.picks, stats.avoided_picks, stats.repeated_picks) == (("a", "b"), 3, 0, 0)


GROUPS = [f"g{i}" for i in range(6)]

events = st.lists(
    st.tuples(
        st.sampled_from(GROUPS),
        st.one_of(st.none(), st.integers(min_value=0, max_value=20_000)),  # None: a failure
        st.integers(min_value=0, max_value=700_000),  # when, relative to T0
    ),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(
    groups=st.lists(st.sampled_from(GROUPS), min_size=1, max_size=6, unique=True),
    history=events,
    exclude=st.sets(st.sampled_from(GROUPS)),
    now=st.integers(min_value=0, max_value=1_400_000),
    rotations=st.integers(min_value=0, max_value=6),
)
def test_pick_prefers_untried_then_available(
    groups: list[str],
    history: list[tuple[str, int | None, int]],
    exclude: set[str],
    now: int,
    rotations: int,
) -> None:
    selector = GroupSelector(groups)
    for group, latency, at in history:
        if latency is None:
            selector.faults.record_failure(group, T0 + at)
        else:
            selector.faults.record_latency(group, latency, T0 + at)
    for _ in range(rotations):
        selector.pick(T0 + now)

    chosen = selector.pick(T0 + now, exclude=exclude)

    assert chosen in groups
    untried = [g for g in groups if g not in exclude]
    candidates = untried or groups
    # Never an excluded group unless every group is excluded.
    assert chosen in candidates
    # Never an avoided group while an available one is among the candidates.
    if any(selector.faults.is_available(g, T0 + now) for g in candidates):
        assert selector.faults.is_available(chosen, T0 + now)
    else:
        # All avoided: the one available soonest.
        soonest = min(selector.faults.available_from(g) for g in candidates)
        assert selector.faults.available_from(chosen) == soonest
