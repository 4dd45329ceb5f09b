"""The latency fault table: which latencies and failures avoid a group, and for how long."""

from __future__ import annotations

import dataclasses

import pytest

from delaymq.client.faults import AvoidancePolicy, LatencyFaultTable

T0 = 1_700_000_000_000  # an epoch ms; nothing reads a clock


@pytest.mark.parametrize(
    ("latency_ms", "avoided_for_ms"),
    [
        (0, 0),
        (100, 0),
        (549, 0),
        (550, 30_000),
        (999, 30_000),
        (1_000, 60_000),
        (1_999, 60_000),
        (2_000, 120_000),
        (3_000, 180_000),
        (14_999, 180_000),
        (15_000, 600_000),
        (120_000, 600_000),
    ],
)
def test_latency_avoids_the_group_for_its_step(latency_ms: int, avoided_for_ms: int) -> None:
    table = LatencyFaultTable()
    until = table.record_latency("g1", latency_ms, T0)
    assert until == T0 + avoided_for_ms
    assert table.available_from("g1") == T0 + avoided_for_ms
    assert table.is_available("g1", T0 + avoided_for_ms)
    assert table.is_available("g1", T0) is (avoided_for_ms == 0)
    if avoided_for_ms:
        assert not table.is_available("g1", T0 + avoided_for_ms - 1)


def test_failure_avoids_for_the_longest_step() -> None:
    table = LatencyFaultTable()
    assert table.record_failure("g1", T0) == T0 + 600_000
    assert not table.is_available("g1", T0 + 599_999)
    assert table.is_available("g1", T0 + 600_000)
    assert table.last_failure("g1") == T0


def test_unknown_group_is_available() -> None:
    table = LatencyFaultTable()
    assert table.is_available("never-seen", T0)
    assert table.available_from("never-seen") == 0
    assert table.last_failure("never-seen") is None


def test_latest_observation_wins() -> None:
    """A fast answer from an avoided group (tried as a last resort) puts it straight back."""
    table = LatencyFaultTable()
    table.record_failure("g1", T0)
    table.record_latency("g1", 20, T0 + 1_000)
    assert table.is_available("g1", T0 + 1_000)
    table.record_latency("g1", 1_200, T0 + 2_000)
    assert table.available_from("g1") == T0 + 62_000
    table.record_success("g1", T0 + 3_000)
    assert table.is_available("g1", T0 + 3_000)
    # The failure is remembered for ordering even after the group recovered.
    assert table.last_failure("g1") == T0


def test_consecutive_failures_reset_on_an_answer() -> None:
    table = LatencyFaultTable()
    table.record_failure("g1", T0)
    table.record_failure("g1", T0 + 10)
    (entry,) = table.statistics().entries
    assert entry.consecutive_failures == 2
    table.record_latency("g1", 5, T0 + 20)
    (entry,) = table.statistics().entries
    assert entry.consecutive_failures == 0
    assert entry.last_latency_ms == 5


def test_forget_drops_the_entry() -> None:
    table = LatencyFaultTable()
    table.record_failure("g1", T0)
    table.forget("g1")
    assert "g1" not in table
    assert table.is_available("g1", T0)
    table.forget("g1")  # forgetting an unknown group is fine


def test_retain_keeps_only_the_named_groups() -> None:
    table = LatencyFaultTable()
    for group in ("a", "b", "c"):
        table.record_failure(group, T0)
    table.retain(["b", "z"])
    assert [e.group for e in table.statistics().entries] == ["b"]


def test_least_recently_failed() -> None:
    table = LatencyFaultTable()
    table.record_failure("b", T0 + 5)
    table.record_failure("a", T0 + 9)
    table.record_failure("c", T0 + 1)
    assert table.least_recently_failed(["a", "b", "c"]) == "c"
    assert table.least_recently_failed(["a", "b"]) == "b"
    # A group that never failed counts as failed longest ago.
    assert table.least_recently_failed(["a", "new"]) == "new"
    assert table.least_recently_failed([]) is None


def test_soonest_available_prefers_the_shortest_wait_then_the_oldest_failure() -> None:
    table = LatencyFaultTable()
    table.record_failure("broken", T0)  # avoided until T0 + 600 s
    table.record_latency("slow", 1_500, T0 + 100)  # avoided until T0 + 60.1 s
    assert table.soonest_available(["broken", "slow"]) == "slow"
    table.record_failure("x", T0 + 200)
    table.record_failure("y", T0 + 200)
    assert table.soonest_available(["y", "x"]) == "y"  # full tie: the first named


def test_statistics_is_a_frozen_snapshot() -> None:
    table = LatencyFaultTable()
    table.record_latency("g1", 700, T0)
    table.record_failure("g2", T0)
    table.record_success("g3", T0)
    stats = table.statistics()
    assert (stats.latencies_recorded, stats.failures_recorded, stats.successes_recorded) == (1, 1, 1)
    assert [(e.group, e.available_from_ms) for e in stats.entries] == [
        ("g1", T0 + 30_000),
        ("g2", T0 + 600_000),
        ("g3", T0),
    ]
    table.record_failure("g1", T0)
    assert stats.entries[0].last_failure_ms is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.failures_recorded = 7  # type: ignore[misc]


def test_custom_policy() -> None:
    policy = AvoidancePolicy(latency_steps_ms=[100, 200], avoid_ms=[1_000, 5_000], failure_avoid_ms=9_000)
    assert policy.latency_steps_ms == (100, 200)  # stored as tuples: the policy is immutable
    table = LatencyFaultTable(policy)
    assert table.record_latency("g", 99, T0) == T0
    assert table.record_latency("g", 150, T0) == T0 + 1_000
    assert table.record_latency("g", 250, T0) == T0 + 5_000
    assert table.record_failure("g", T0) == T0 + 9_000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency_steps_ms": (550, 1_000), "avoid_ms": (30_000,)}, "avoid_ms has 1 entries"),
        ({"latency_steps_ms": (1_000, 550), "avoid_ms": (1, 2)}, "latency_steps_ms must be strictly increasing"),
        ({"latency_steps_ms": (550, 550), "avoid_ms": (1, 2)}, "latency_steps_ms must be strictly increasing"),
        ({"latency_steps_ms": (550, 1_000), "avoid_ms": (60_000, 30_000)}, "avoid_ms must not decrease"),
        ({"latency_steps_ms": (-1,), "avoid_ms": (1,)}, "latency_steps_ms entry -1 must be an int >= 0"),
        ({"latency_steps_ms": (1,), "avoid_ms": (-5,)}, "avoid_ms entry -5 must be an int >= 0"),
        ({"failure_avoid_ms": -1}, "failure_avoid_ms -1 must be an int >= 0"),
    ],
)
def test_policy_refuses_bad_tables(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AvoidancePolicy(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_name_the_field() -> None:
    table = LatencyFaultTable()
    with pytest.raises(ValueError, match="latency_ms -1 must be >= 0"):
        table.record_latency("g", -1, T0)
    with pytest.raises(ValueError, match="group '' must be a non-empty str"):
        table.record_failure("", T0)
