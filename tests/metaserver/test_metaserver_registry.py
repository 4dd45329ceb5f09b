"""The metaserver registry: registration, eviction, states, routes, versions, snapshots."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.metaserver.registry import (
    DEPOSED_KEPT,
    Registry,
    RegistryError,
    ServerInfo,
    Superseded,
)
from delaymq.protocol.routes import GroupState, RouteKind

T0 = 1_700_000_000_000
EVICT = 30_000
ROUTES = [
    ("delayed-producer", None),
    ("immediate-producer", None),
    ("consumer", None),
    ("scheduler-delivery", "orders.created"),
]


def info(
    group: str = "rt1",
    kind: str = "realtime",
    role: str = "master",
    address: str = "10.0.0.1:20881",
    software_version: str = "0.1.0",
    incarnation: str | None = None,
) -> dict[str, Any]:
    fields = {"group": group, "kind": kind, "role": role, "address": address, "software_version": software_version}
    return fields if incarnation is None else {**fields, "incarnation": incarnation}


def groups(registry: Registry, route: str, now_ms: int, subject: str | None = None) -> list[str]:
    return [g.group for g in registry.route(route, now_ms=now_ms, subject=subject).groups]


def all_answers(registry: Registry, now_ms: int) -> tuple[int, list[Any]]:
    answers = [registry.route(r, now_ms=now_ms, subject=s) for r, s in ROUTES]
    versions = {a.version for a in answers}
    assert len(versions) == 1
    return versions.pop(), [a.as_dict()["groups"] for a in answers]


# -- registration and routes -------------------------------------------------


def test_registered_groups_are_routed_by_kind_with_master_and_slaves() -> None:
    registry = Registry()
    registry.register(info("sched1", "scheduler", "master", "s1:1"), now_ms=T0)
    registry.register(info("sched1", "scheduler", "slave", "s2:1"), now_ms=T0)
    registry.register(info("rt2", "realtime", "master", "r2:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "master", "r1:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "slave", "r1b:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "slave", "r1a:1"), now_ms=T0)

    delayed = registry.route("delayed-producer", now_ms=T0 + 1).as_dict()
    assert delayed["groups"] == [
        {"group": "sched1", "kind": "scheduler", "state": "RW", "address": "s1:1", "slaves": ["s2:1"]}
    ]
    consumer = registry.route(RouteKind.CONSUMER, now_ms=T0 + 1).as_dict()
    assert consumer["groups"] == [
        {"group": "rt1", "kind": "realtime", "state": "RW", "address": "r1:1", "slaves": ["r1a:1", "r1b:1"]},
        {"group": "rt2", "kind": "realtime", "state": "RW", "address": "r2:1", "slaves": []},
    ]
    assert groups(registry, "immediate-producer", T0 + 1) == ["rt1", "rt2"]
    assert groups(registry, "scheduler-delivery", T0 + 1, subject="any.subject") == ["rt1", "rt2"]
    assert msgpack.unpackb(msgpack.packb(consumer)) == consumer


def test_register_accepts_a_server_info_and_ignores_unknown_request_keys() -> None:
    registry = Registry()
    registry.register(ServerInfo("rt1", "realtime", "master", "a:1", "0.1"), now_ms=T0)
    registry.register({**info("rt2", address="b:1"), "lease_epoch": 7}, now_ms=T0)
    assert groups(registry, "consumer", T0) == ["rt1", "rt2"]


def test_group_without_master_is_not_routed_until_one_registers() -> None:
    registry = Registry()
    registry.register(info("rt1", role="slave", address="b:1"), now_ms=T0)
    assert groups(registry, "consumer", T0) == []
    assert [row.evicted for row in registry.status(T0)] == [False]
    registry.register(info("rt1", role="master", address="a:1"), now_ms=T0 + 10)
    assert registry.route("consumer", now_ms=T0 + 10).groups[0].slaves == ("b:1",)


def test_heartbeat_reply_tells_state_master_version_and_interval() -> None:
    registry = Registry(heartbeat_interval_ms=2_000, evict_after_ms=10_000)
    registry.register(info(role="master", address="a:1"), now_ms=T0)
    reply = registry.register(info(role="slave", address="b:1"), now_ms=T0)
    assert reply.master == "a:1"
    assert reply.state is GroupState.RW
    assert reply.heartbeat_interval_ms == 2_000
    assert reply.route_version == registry.route("consumer", now_ms=T0).version
    registry.set_state("rt1", "R")
    assert registry.heartbeat("rt1", "b:1", now_ms=T0 + 1).state is GroupState.R


def test_light_heartbeat_of_unknown_group_or_server_names_the_field() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    with pytest.raises(RegistryError) as unknown_group:
        registry.heartbeat("nope", "a:1", now_ms=T0)
    assert unknown_group.value.field == "group"
    with pytest.raises(RegistryError) as unknown_server:
        registry.heartbeat("rt1", "z:1", now_ms=T0)
    assert unknown_server.value.field == "address"
    assert "register first" in str(unknown_server.value)


# -- eviction ----------------------------------------------------------------


def test_master_is_evicted_exactly_at_evict_after_ms_of_silence() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    assert groups(registry, "consumer", T0 + EVICT - 1) == ["rt1"]
    assert groups(registry, "consumer", T0 + EVICT) == []
    [row] = registry.status(T0 + EVICT)
    assert (row.group, row.address, row.evicted, row.seconds_since_heartbeat) == ("rt1", "a:1", True, 30.0)


def test_evicted_group_returns_when_heartbeats_resume() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    live = registry.route("consumer", now_ms=T0)
    evicted = registry.route("consumer", now_ms=T0 + 45_000)
    assert evicted.groups == () and evicted.version != live.version
    registry.heartbeat("rt1", "a:1", now_ms=T0 + 50_000)
    back = registry.route("consumer", now_ms=T0 + 50_000)
    assert back.groups == live.groups
    assert back.version not in (live.version, evicted.version)
    assert registry.status(T0 + 50_000)[0].evicted is False


def test_heartbeats_keep_a_group_routed_past_the_eviction_time() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    for beat in range(1, 20):
        registry.heartbeat("rt1", "a:1", now_ms=T0 + beat * 5_000)
    assert groups(registry, "consumer", T0 + 19 * 5_000 + EVICT - 1) == ["rt1"]


def test_silent_slave_drops_out_of_the_slave_list() -> None:
    registry = Registry()
    registry.register(info(role="master", address="a:1"), now_ms=T0)
    registry.register(info(role="slave", address="b:1"), now_ms=T0)
    registry.heartbeat("rt1", "a:1", now_ms=T0 + 20_000)
    before = registry.route("consumer", now_ms=T0 + 20_000)
    after = registry.route("consumer", now_ms=T0 + EVICT)
    assert before.groups[0].slaves == ("b:1",)
    assert after.groups[0].slaves == () and after.version != before.version


def test_expire_notices_eviction_and_time_never_runs_backwards() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    assert registry.expire(T0 + EVICT - 1) is False
    assert registry.expire(T0 + EVICT) is True
    assert registry.expire(T0 + EVICT + 1) is False
    # An earlier time than one already seen counts as the latest seen.
    assert groups(registry, "consumer", T0 + 1) == []
    assert registry.statistics().evicted_groups == 1


def test_statistics_is_a_frozen_snapshot() -> None:
    registry = Registry()
    registry.register(info("rt1", address="a:1"), now_ms=T0)
    registry.register(info("rt1", role="slave", address="b:1"), now_ms=T0)
    registry.register(info("rt2", address="c:1"), now_ms=T0 + 20_000)
    registry.expire(T0 + EVICT)
    stats = registry.statistics()
    assert (stats.groups, stats.servers, stats.routed_groups, stats.evicted_groups, stats.evicted_servers) == (
        2,
        3,
        1,
        1,
        2,
    )
    assert stats.version == registry.route("consumer", now_ms=T0 + EVICT).version
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.groups = 5  # type: ignore[misc]


# -- mastership --------------------------------------------------------------


def test_latest_master_claim_wins_and_the_old_master_is_refused_not_routed() -> None:
    registry = Registry()
    registry.register(info(role="master", address="a:1"), now_ms=T0)
    registry.register(info(role="slave", address="b:1"), now_ms=T0)
    first = registry.route("consumer", now_ms=T0)
    registry.register(info(role="master", address="b:1"), now_ms=T0 + 1)  # failover
    with pytest.raises(Superseded) as refused:  # the old master still claims: refused, no flapping
        registry.register(info(role="master", address="a:1"), now_ms=T0 + 2)
    assert refused.value.field == "address" and refused.value.by == "b:1"
    assert "a:1 was superseded as master of group 'rt1' by b:1" in str(refused.value)
    with pytest.raises(Superseded):
        registry.heartbeat("rt1", "a:1", now_ms=T0 + 2)
    after = registry.route("consumer", now_ms=T0 + 2)
    assert (after.groups[0].address, after.groups[0].slaves) == ("b:1", ())
    assert after.version != first.version
    assert [(r.address, r.role.value, r.is_master) for r in registry.status(T0 + 2)] == [("b:1", "master", True)]
    assert registry.superseded("rt1") == {"a:1": "b:1"}
    # Demoted properly, then promoted again: it claims anew and takes over.
    registry.register(info(role="slave", address="a:1"), now_ms=T0 + 3)
    assert registry.superseded("rt1") == {}
    registry.register(info(role="master", address="a:1"), now_ms=T0 + 4)
    assert registry.route("consumer", now_ms=T0 + 4).groups[0].address == "a:1"
    assert registry.superseded("rt1") == {"b:1": "a:1"}


def test_a_new_master_address_supersedes_a_dead_master_at_once() -> None:
    """A restart on a new port: routes point at the new address at once, not after eviction."""
    registry = Registry()
    registry.register(info(role="master", address="127.0.0.1:4001", incarnation="run1"), now_ms=T0)
    before = registry.route("immediate-producer", now_ms=T0 + 1_000)
    registry.register(info(role="master", address="127.0.0.1:4002", incarnation="run2"), now_ms=T0 + 1_000)
    after = registry.route("immediate-producer", now_ms=T0 + 1_000)
    assert [g.address for g in after.groups] == ["127.0.0.1:4002"]
    assert after.version > before.version
    assert [r.address for r in registry.status(T0 + 1_000)] == ["127.0.0.1:4002"]


def test_a_restarted_deposed_master_registers_again_and_wins() -> None:
    registry = Registry()
    registry.register(info(role="master", address="a:1", incarnation="a-run1"), now_ms=T0)
    registry.register(info(role="master", address="b:1", incarnation="b-run1"), now_ms=T0 + 1)
    with pytest.raises(Superseded):  # the same run of a:1: refused
        registry.register(info(role="master", address="a:1", incarnation="a-run1"), now_ms=T0 + 2)
    registry.register(info(role="master", address="a:1", incarnation="a-run2"), now_ms=T0 + 3)  # restarted
    assert registry.route("consumer", now_ms=T0 + 3).groups[0].address == "a:1"
    with pytest.raises(Superseded):
        registry.heartbeat("rt1", "b:1", now_ms=T0 + 4)


def test_a_master_restarting_on_its_own_address_is_routed_at_its_registration() -> None:
    registry = Registry()
    registry.register(info(role="master", address="a:1", incarnation="run1"), now_ms=T0)
    assert groups(registry, "consumer", T0 + EVICT) == []  # dead long enough to be evicted
    registry.register(info(role="master", address="a:1", incarnation="run2"), now_ms=T0 + EVICT + 5)
    assert groups(registry, "consumer", T0 + EVICT + 5) == ["rt1"]
    assert registry.superseded("rt1") == {}
    registry.heartbeat("rt1", "a:1", now_ms=T0 + EVICT + 10)  # same address, same member


def test_deposed_masters_survive_a_restore_and_are_remembered_boundedly() -> None:
    registry = Registry()
    for n in range(DEPOSED_KEPT + 3):
        registry.register(info(role="master", address=f"m{n}:1", incarnation=f"run{n}"), now_ms=T0 + n)
    last = f"m{DEPOSED_KEPT + 2}:1"
    assert len(registry.superseded("rt1")) == DEPOSED_KEPT
    assert "m0:1" not in registry.superseded("rt1")  # the oldest forgotten first
    restored = Registry.restore(msgpack.unpackb(msgpack.packb(registry.snapshot())), now_ms=T0 + 100)
    assert restored.superseded("rt1") == registry.superseded("rt1")
    with pytest.raises(Superseded):
        restored.register(info(role="master", address="m5:1", incarnation="run5"), now_ms=T0 + 101)
    assert restored.route("consumer", now_ms=T0 + 101).groups[0].address == last


def test_a_format_1_snapshot_is_still_restored() -> None:
    snapshot = build_cluster().snapshot()
    snapshot["format"] = 1
    for group in snapshot["groups"]:
        del group["deposed"]
        for server in group["servers"]:
            del server["incarnation"]
    restored = Registry.restore(snapshot, now_ms=T0)
    assert groups(restored, "consumer", T0) == ["rt1", "rt2"]


def test_group_is_evicted_when_its_master_is_silent_even_with_live_slaves() -> None:
    registry = Registry()
    registry.register(info(role="master", address="a:1"), now_ms=T0)
    registry.register(info(role="slave", address="b:1"), now_ms=T0)
    registry.heartbeat("rt1", "b:1", now_ms=T0 + 25_000)
    assert groups(registry, "consumer", T0 + EVICT) == []


# -- states ------------------------------------------------------------------


def test_read_only_groups_serve_consumers_but_take_no_new_messages() -> None:
    registry = Registry()
    registry.register(info("sched1", "scheduler", address="s:1"), now_ms=T0)
    registry.register(info("rt1", address="a:1"), now_ms=T0)
    registry.register(info("rt2", address="b:1"), now_ms=T0)
    registry.set_state("rt1", "R")
    registry.set_state("sched1", GroupState.R)
    assert groups(registry, "delayed-producer", T0) == []
    assert groups(registry, "immediate-producer", T0) == ["rt2"]
    assert groups(registry, "scheduler-delivery", T0, subject="s") == ["rt2"]
    consumer = registry.route("consumer", now_ms=T0).as_dict()["groups"]
    assert [(g["group"], g["state"]) for g in consumer] == [("rt1", "R"), ("rt2", "RW")]


def test_nrw_groups_are_left_out_of_every_route() -> None:
    registry = Registry()
    registry.register(info("sched1", "scheduler", address="s:1"), now_ms=T0)
    registry.register(info("rt1", address="a:1"), now_ms=T0)
    registry.set_state("rt1", "NRW")
    registry.set_state("sched1", "NRW")
    for route, subject in ROUTES:
        assert groups(registry, route, T0, subject) == []
    assert {row.state for row in registry.status(T0)} == {GroupState.NRW}


def test_state_survives_re_registration_and_eviction() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    registry.set_state("rt1", "R")
    registry.register(info(address="a:1", software_version="0.2.0"), now_ms=T0 + 40_000)
    registry.register(info(address="c:1", role="master"), now_ms=T0 + 40_000)
    assert registry.route("consumer", now_ms=T0 + 40_000).groups[0].state is GroupState.R


def test_set_state_names_unknown_group_or_state() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    with pytest.raises(RegistryError) as group:
        registry.set_state("nope", "R")
    assert group.value.field == "group" and "nope" in str(group.value)
    with pytest.raises(RegistryError) as state:
        registry.set_state("rt1", "WO")
    assert state.value.field == "state" and "'WO'" in str(state.value) and "'NRW'" in str(state.value)


# -- versions ----------------------------------------------------------------


def test_version_unchanged_by_heartbeats_and_queries() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    registry.register(info(role="slave", address="b:1"), now_ms=T0)
    version, answers = all_answers(registry, T0)
    for beat in range(1, 10):
        now = T0 + beat * 5_000
        registry.register(info(address="a:1"), now_ms=now)
        registry.heartbeat("rt1", "b:1", now_ms=now)
        assert registry.expire(now) is False
        assert all_answers(registry, now) == (version, answers)


def test_version_changes_on_each_kind_of_change() -> None:
    registry = Registry()
    now = T0
    seen = [registry.route("consumer", now_ms=now).version]

    def changed(step: str) -> None:
        version = registry.route("consumer", now_ms=now).version
        assert version not in seen, step
        seen.append(version)

    registry.register(info(address="a:1"), now_ms=now)
    changed("new group")
    registry.register(info(role="slave", address="b:1"), now_ms=now)
    changed("new slave")
    registry.register(info(role="master", address="b:1"), now_ms=now)
    changed("mastership change (new master address)")
    registry.register(info(role="slave", address="a:1"), now_ms=now)
    changed("old master comes back as a slave")
    registry.set_state("rt1", "R")
    changed("state change")
    now += EVICT
    changed("eviction noticed at query time")
    registry.heartbeat("rt1", "b:1", now_ms=now)
    changed("return from eviction")
    registry.heartbeat("rt1", "a:1", now_ms=now)
    changed("slave back from eviction")
    registry.forget("rt1", "a:1")
    changed("server forgotten")


def test_changes_no_route_can_see_keep_the_version() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    registry.register(info("rt2", address="b:1"), now_ms=T0 + 20_000)
    version = registry.route("consumer", now_ms=T0 + EVICT).version  # rt1 evicted
    registry.set_state("rt1", "R")  # rt1 is not routed: no answer changes
    registry.register(info("rt2", address="b:1", software_version="0.2.0"), now_ms=T0 + EVICT)
    assert registry.route("consumer", now_ms=T0 + EVICT).version == version
    assert registry.dirty  # still worth persisting


def test_eviction_bumps_version_without_expire_being_called() -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    registry.register(info("rt2", address="b:1"), now_ms=T0 + 10_000)
    v1 = registry.route("immediate-producer", now_ms=T0 + EVICT - 1).version
    v2 = registry.route("immediate-producer", now_ms=T0 + EVICT).version
    v3 = registry.route("immediate-producer", now_ms=T0 + 10_000 + EVICT).version
    assert len({v1, v2, v3}) == 3 and v1 < v2 < v3


# -- persistence -------------------------------------------------------------


def build_cluster() -> Registry:
    registry = Registry()
    registry.register(info("sched1", "scheduler", "master", "s1:1"), now_ms=T0)
    registry.register(info("sched1", "scheduler", "slave", "s2:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "master", "r1:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "slave", "r1b:1"), now_ms=T0)
    registry.register(info("rt1", "realtime", "master", "r1b:1"), now_ms=T0)  # failover to r1b
    registry.register(info("rt2", "realtime", "master", "r2:1"), now_ms=T0)
    registry.register(info("rt3", "realtime", "master", "r3:1"), now_ms=T0)
    registry.set_state("rt2", "R")
    registry.set_state("rt3", "NRW")
    return registry


def test_restore_answers_the_same_routes_at_once() -> None:
    registry = build_cluster()
    before = all_answers(registry, T0 + 1_000)
    snapshot = msgpack.unpackb(msgpack.packb(registry.snapshot()))
    restored = Registry.restore(snapshot, now_ms=T0 + 60_000)
    after = all_answers(restored, T0 + 60_000)
    assert after[1] == before[1]
    assert after[0] > before[0]
    assert not restored.dirty
    assert restored.snapshot()["groups"] == snapshot["groups"]


def test_restore_gives_every_server_a_fresh_grace_period() -> None:
    registry = build_cluster()
    registry.heartbeat("rt2", "r2:1", now_ms=T0 + 20_000)
    assert groups(registry, "consumer", T0 + EVICT) == ["rt2"]  # the others are silent
    restored = Registry.restore(registry.snapshot(), now_ms=T0 + 100_000)
    assert groups(restored, "consumer", T0 + 100_000) == ["rt1", "rt2"]
    assert groups(restored, "consumer", T0 + 100_000 + EVICT - 1) == ["rt1", "rt2"]
    assert groups(restored, "consumer", T0 + 100_000 + EVICT) == []


def test_restore_keeps_master_claims_so_a_new_claim_still_wins() -> None:
    restored = Registry.restore(build_cluster().snapshot(), now_ms=T0)
    assert restored.route("consumer", now_ms=T0).groups[0].address == "r1b:1"
    restored.register(info("rt1", "realtime", "slave", "r1:1"), now_ms=T0)
    restored.register(info("rt1", "realtime", "master", "r1:1"), now_ms=T0)
    assert restored.route("consumer", now_ms=T0).groups[0].address == "r1:1"


def test_version_never_repeats_across_a_restore_from_an_older_snapshot() -> None:
    registry = build_cluster()
    snapshot = registry.snapshot()
    issued = {registry.route("consumer", now_ms=T0 + t).version for t in (0, EVICT, EVICT + 5)}
    restored = Registry.restore(snapshot, now_ms=T0 + EVICT + 10)
    assert restored.route("consumer", now_ms=T0 + EVICT + 10).version not in issued


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda s: s.update(format=99), "snapshot.format"),
        (lambda s: s.update(version="7"), "snapshot.version"),
        (lambda s: s["groups"][0].update(kind="delay"), "snapshot.groups[0].kind"),
        (lambda s: s["groups"][1].update(state="rw"), "snapshot.groups[1].state"),
        (lambda s: s["groups"][0]["servers"][0].update(address="nohost"), "snapshot.groups[0].servers[0].address"),
        (lambda s: s["groups"][0]["servers"][0].pop("role"), "snapshot.groups[0].servers[0].role"),
    ],
)
def test_restore_refuses_a_damaged_snapshot_naming_the_field(damage: Any, field: str) -> None:
    snapshot = build_cluster().snapshot()
    damage(snapshot)
    with pytest.raises(RegistryError) as error:
        Registry.restore(snapshot, now_ms=T0)
    assert error.value.field == field


def test_dirty_tracks_changes_worth_persisting_not_heartbeats() -> None:
    registry = Registry()
    assert not registry.dirty
    registry.register(info(address="a:1"), now_ms=T0)
    assert registry.dirty
    registry.mark_persisted(registry.changes)
    for beat in range(1, 4):
        registry.register(info(address="a:1"), now_ms=T0 + beat * 5_000)
        registry.heartbeat("rt1", "a:1", now_ms=T0 + beat * 5_000)
    registry.expire(T0 + 100_000)  # eviction is not persisted: restore re-grants grace anyway
    assert not registry.dirty
    taken = registry.changes
    registry.set_state("rt1", "R")
    registry.mark_persisted(taken)  # a snapshot taken before the state change
    assert registry.dirty
    registry.mark_persisted(registry.changes)
    assert not registry.dirty
    registry.register(info(role="slave", address="b:1"), now_ms=T0 + 100_000)
    assert registry.statistics().dirty


# -- validation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field", "mentions"),
    [
        ({"kind": "delay"}, "kind", "'scheduler'"),
        ({"kind": None}, "kind", "None"),
        ({"role": "leader"}, "role", "'slave'"),
        ({"group": ""}, "group", "empty"),
        ({"group": "g" * 129}, "group", "128"),
        ({"group": "orders east"}, "group", "A-Z"),
        ({"group": "grp/1"}, "group", "A-Z"),
        ({"group": 7}, "group", "string"),
        ({"address": "host"}, "address", "host:port"),
        ({"address": ":9000"}, "address", "host:port"),
        ({"address": "host:0"}, "address", "1..65535"),
        ({"address": "host:65536"}, "address", "1..65535"),
        ({"address": "host:http"}, "address", "port"),
        ({"address": "host:080"}, "address", "port"),
        ({"address": "host:+80"}, "address", "port"),
        ({"address": "::1:80"}, "address", "brackets"),
        ({"address": "my host:80"}, "address", "host"),
        ({"address": "h" * 256 + ":80"}, "address", "255"),
        ({"software_version": ""}, "software_version", "empty"),
        ({"software_version": "v" * 65}, "software_version", "64"),
    ],
)
def test_register_refuses_bad_fields_naming_them(overrides: dict[str, Any], field: str, mentions: str) -> None:
    registry = Registry()
    with pytest.raises(RegistryError) as error:
        registry.register({**info(), **overrides}, now_ms=T0)
    assert isinstance(error.value, ValueError)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ") and mentions in str(error.value)
    assert registry.statistics().groups == 0 and not registry.dirty


@pytest.mark.parametrize("address", ["localhost:1", "10.0.0.1:65535", "[::1]:20881", "broker-3.example.com:20881"])
def test_register_accepts_good_addresses(address: str) -> None:
    registry = Registry()
    registry.register(info(address=address, group="g" * 128), now_ms=T0)
    assert registry.route("consumer", now_ms=T0).groups[0].address == address


def test_missing_request_field_and_kind_mismatch_are_named() -> None:
    registry = Registry()
    request = info()
    del request["role"]
    with pytest.raises(RegistryError) as missing:
        registry.register(request, now_ms=T0)
    assert missing.value.field == "role"
    registry.register(info("sched1", "scheduler", address="a:1"), now_ms=T0)
    with pytest.raises(RegistryError) as mismatch:
        registry.register(info("sched1", "realtime", address="b:1"), now_ms=T0)
    assert mismatch.value.field == "kind" and "scheduler group" in str(mismatch.value)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda r: r.route("producer", now_ms=T0), "route"),
        (lambda r: r.route("scheduler-delivery", now_ms=T0), "subject"),
        (lambda r: r.route("scheduler-delivery", now_ms=T0, subject=""), "subject"),
        (lambda r: r.route("scheduler-delivery", now_ms=T0, subject="é" * 40_000), "subject"),
        (lambda r: r.route("consumer", now_ms=-1), "now_ms"),
        (lambda r: r.route("consumer", now_ms=1.5), "now_ms"),
        (lambda r: r.register(info(), now_ms=True), "now_ms"),
        (lambda r: r.forget("rt1", "z:1"), "address"),
        (lambda r: r.mark_persisted(r.changes + 1), "changes"),
        (lambda r: Registry(evict_after_ms=0), "evict_after_ms"),
        (lambda r: Registry(evict_after_ms=5_000, heartbeat_interval_ms=5_000), "heartbeat_interval_ms"),
    ],
)
def test_other_refusals_name_the_field(call: Any, field: str) -> None:
    registry = Registry()
    registry.register(info(address="a:1"), now_ms=T0)
    with pytest.raises(RegistryError) as error:
        call(registry)
    assert error.value.field == field


# -- properties against a plain model -----------------------------------------


class Model:
    """The routing rules restated as plainly as possible."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Any]] = {}
        self.claims = 0

    def refuses(self, group: str, address: str, role: str | None) -> bool:
        """A deposed master's heartbeat (role None) or its claim of mastership is refused."""
        return address in self.groups.get(group, {"deposed": set()})["deposed"] and role != "slave"

    def register(self, group: str, kind: str, address: str, role: str, now: int) -> None:
        entry = self.groups.setdefault(group, {"kind": kind, "state": "RW", "servers": {}, "deposed": set()})
        entry["deposed"].discard(address)
        server = entry["servers"].get(address)
        if server is None or server["role"] != role:
            self.claims += 1
            entry["servers"][address] = {"role": role, "claim": self.claims, "last": now}
            if role == "master":  # the newest claim supersedes every other master
                for other in [a for a, s in entry["servers"].items() if s["role"] == "master" and a != address]:
                    del entry["servers"][other]
                    entry["deposed"].add(other)
        server = entry["servers"][address]
        server["last"] = now

    def routes(self, now: int) -> list[list[dict[str, Any]]]:
        view = []
        for name in sorted(self.groups):
            entry = self.groups[name]
            live = {a: s for a, s in entry["servers"].items() if now - s["last"] < EVICT}
            masters = [(s["claim"], a) for a, s in entry["servers"].items() if s["role"] == "master"]
            if not masters or max(masters)[1] not in live:
                continue
            slaves = sorted(a for a, s in live.items() if s["role"] == "slave")
            view.append(
                {
                    "group": name,
                    "kind": entry["kind"],
                    "state": entry["state"],
                    "address": max(masters)[1],
                    "slaves": slaves,
                }
            )
        rules = [("scheduler", {"RW"}), ("realtime", {"RW"}), ("realtime", {"RW", "R"}), ("realtime", {"RW"})]
        return [[g for g in view if g["kind"] == kind and g["state"] in states] for kind, states in rules]


GROUP_KINDS = {"sch": "scheduler", "rt1": "realtime", "rt2": "realtime"}
step_ms = st.sampled_from([0, 1, 4_999, 5_000, EVICT - 1, EVICT, EVICT + 1]) | st.integers(0, 2 * EVICT)
operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("register"),
            st.sampled_from(sorted(GROUP_KINDS)),
            st.sampled_from(["a:1", "b:1", "c:1"]),
            st.sampled_from(["master", "slave"]),
            step_ms,
        ),
        st.tuples(
            st.just("heartbeat"), st.sampled_from(sorted(GROUP_KINDS)), st.sampled_from(["a:1", "b:1", "c:1"]), step_ms
        ),
        st.tuples(st.just("state"), st.sampled_from(sorted(GROUP_KINDS)), st.sampled_from(["RW", "R", "NRW"])),
        st.tuples(st.just("wait"), step_ms),
    ),
    max_size=40,
)


def run(ops: list[tuple[Any, ...]], check: Any) -> tuple[Registry, Model, int]:
    registry, model, now = Registry(), Model(), T0
    for op in ops:
        if op[0] == "register":
            _, group, address, role, step = op
            now += step
            if model.refuses(group, address, role):
                with pytest.raises(Superseded):
                    registry.register(info(group, GROUP_KINDS[group], role, address), now_ms=now)
            else:
                registry.register(info(group, GROUP_KINDS[group], role, address), now_ms=now)
                model.register(group, GROUP_KINDS[group], address, role, now)
        elif op[0] == "heartbeat":
            _, group, address, step = op
            now += step
            known = address in model.groups.get(group, {"servers": {}})["servers"]
            if model.refuses(group, address, None):
                with pytest.raises(Superseded):
                    registry.heartbeat(group, address, now_ms=now)
            elif known:
                registry.heartbeat(group, address, now_ms=now)
                model.groups[group]["servers"][address]["last"] = now
            else:
                with pytest.raises(RegistryError):
                    registry.heartbeat(group, address, now_ms=now)
        elif op[0] == "state":
            _, group, state = op
            if group in model.groups:
                registry.set_state(group, state)
                model.groups[group]["state"] = state
            else:
                with pytest.raises(RegistryError):
                    registry.set_state(group, state)
        else:
            now += op[1]
            if op[1] % 2:  # sometimes noticed by expire, otherwise by the next query
                registry.expire(now)
        check(registry, model, now)
    return registry, model, now


@settings(max_examples=300, deadline=None)
@given(operations)
def test_routes_match_the_model_and_version_changes_exactly_with_answers(ops: list[tuple[Any, ...]]) -> None:
    history: dict[int, list[Any]] = {}
    previous: list[tuple[int, list[Any]]] = []

    def check(registry: Registry, model: Model, now: int) -> None:
        version, answers = all_answers(registry, now)
        assert answers == model.routes(now)
        assert history.setdefault(version, answers) == answers  # a version never means two answers
        if previous:
            last_version, last_answers = previous[-1]
            assert (version != last_version) == (answers != last_answers)
            assert version >= last_version
        previous.append((version, answers))

    run(ops, check)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_restore_answers_routes_as_if_every_server_had_just_heartbeated(ops: list[tuple[Any, ...]]) -> None:
    registry, model, now = run(ops, lambda *_: None)
    version = registry.route("consumer", now_ms=now).version
    snapshot = msgpack.unpackb(msgpack.packb(registry.snapshot()))
    restored = Registry.restore(snapshot, now_ms=now + 7)
    for entry in model.groups.values():
        for server in entry["servers"].values():
            server["last"] = now + 7
    restored_version, answers = all_answers(restored, now + 7)
    assert answers == model.routes(now + 7)
    assert restored_version > version
    assert restored.snapshot()["groups"] == snapshot["groups"]
