"""The registry's rules for managed (replicated) groups, sans-IO: epochs, failover, handover.

A managed group's servers send a ``replica`` report; the metaserver, not the
servers, decides who is master, and each change of master gets a new epoch that
is never handed out twice, across restores too.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from delaymq.metaserver.registry import (
    FailoverBlocked,
    HandoverDropped,
    MasterChanged,
    MemberTaken,
    Registry,
    RegistryError,
    Role,
)

T0 = 1_700_000_000_000
FAILOVER = 5_000
GROUP = "sched1"


def member(
    address: str,
    *,
    offset: int = 0,
    epoch: int = 0,
    in_sync: list[str] | None = None,
    handed_over: int | None = None,
    incarnation: str = "run1",
    name: str | None = None,
    role: str = "master",
) -> dict[str, Any]:
    """A scheduler's REGISTER: every server of a managed group registers as master."""
    replica: dict[str, Any] = {"offset": offset, "epoch": epoch}
    if in_sync is not None:
        replica.update(mode="sync", in_sync=in_sync)
    if handed_over is not None:
        replica["handed_over"] = handed_over
    return {
        "group": GROUP,
        "kind": "scheduler",
        "role": role,
        "address": address,
        "software_version": "0.1.0",
        "incarnation": incarnation,
        "member": name or f"folder-{address}",
        "replica": replica,
    }


def beat(registry: Registry, address: str, now: int, **replica: Any) -> Any:
    """A heartbeat reporting the group's current epoch unless ``epoch`` is given (a server holds the epoch it was told)."""
    epochs = [row.epoch for row in registry.status(now) if row.group == GROUP]
    replica.setdefault("epoch", max(epochs, default=0))
    return registry.heartbeat(GROUP, address, now_ms=now, replica={"offset": 0, **replica})


def master_of(registry: Registry, now: int) -> str | None:
    masters = [row.address for row in registry.status(now) if row.group == GROUP and row.is_master]
    return masters[0] if masters else None


def routed_master(registry: Registry, now: int) -> str | None:
    groups = registry.route("delayed-producer", now_ms=now).groups
    return groups[0].address if groups else None


def three_servers(registry: Registry) -> int:
    """a:1 master (first), b:1 and c:1 slaves; the master lists b:1 and c:1 in sync. The group's epoch."""
    first = registry.register(member("a:1"), now_ms=T0)
    registry.register(member("b:1", offset=100), now_ms=T0)
    registry.register(member("c:1", offset=200), now_ms=T0)
    reply = registry.register(member("a:1", offset=300, epoch=first.epoch or 0, in_sync=["b:1", "c:1"]), now_ms=T0)
    assert reply.epoch == first.epoch
    return reply.epoch or 0


# -- roles and epochs ----------------------------------------------------------------


def test_first_server_is_master_at_an_epoch_and_the_next_ones_are_slaves() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    first = registry.register(member("a:1"), now_ms=T0)
    assert (first.role, first.master, first.handover_to) == (Role.MASTER, "a:1", None)
    assert first.epoch is not None and first.epoch >= 1
    assert first.heartbeat_interval_ms == FAILOVER // 5  # a healthy master is never taken for dead
    second = registry.register(member("b:1"), now_ms=T0 + 1)  # registers as master: it is told it is a slave
    assert (second.role, second.master, second.epoch) == (Role.SLAVE, "a:1", first.epoch)
    rows = [(r.address, r.role.value, r.is_master, r.epoch, r.member) for r in registry.status(T0 + 1)]
    assert rows == [
        ("a:1", "master", True, first.epoch, "folder-a:1"),
        ("b:1", "slave", False, first.epoch, "folder-b:1"),
    ]
    route = registry.route("delayed-producer", now_ms=T0 + 1).groups[0]
    assert (route.address, route.slaves) == ("a:1", ("b:1",))
    assert [type(e) for e in registry.take_events()] == [MasterChanged]


def test_groups_without_replica_reports_keep_the_claim_rules_and_interval() -> None:
    registry = Registry(heartbeat_interval_ms=5_000, failover_after_ms=FAILOVER)
    reply = registry.register(
        {"group": "rt1", "kind": "realtime", "role": "master", "address": "r:1", "software_version": "1"}, now_ms=T0
    )
    assert (reply.role, reply.epoch, reply.heartbeat_interval_ms) == (None, None, 5_000)
    assert registry.status(T0)[0].epoch == 0
    assert registry.take_events() == []


def test_the_master_restarted_stays_master_with_a_new_epoch() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    again = registry.register(member("a:1", incarnation="run1"), now_ms=T0 + 1_000)  # the same run: no change
    assert again.epoch == epoch
    restarted = registry.register(member("a:1", incarnation="run2"), now_ms=T0 + 2_000)
    assert restarted.role is Role.MASTER and restarted.epoch is not None and restarted.epoch > epoch
    slave = registry.register(member("b:1", incarnation="run2"), now_ms=T0 + 3_000)  # a slave's restart: no change
    assert (slave.role, slave.epoch) == (Role.SLAVE, restarted.epoch)
    events = registry.take_events()
    assert [(e.reason, e.new, e.epoch) for e in events if isinstance(e, MasterChanged)][-1] == (
        "restart",
        "a:1",
        restarted.epoch,
    )


def test_only_the_master_at_the_groups_epoch_changes_the_in_sync_set_and_hears_it_back() -> None:
    """A report of another term (a deposed master, a new one before its term began) or a
    slave's records nothing: no master can drop a slave the metaserver may still promote."""
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)

    def in_sync(now: int) -> set[str]:
        return {row.address for row in registry.status(now) if row.in_sync}

    assert in_sync(T0) == {"b:1", "c:1"}
    stale = beat(registry, "a:1", T0 + 100, offset=300, epoch=epoch - 1, in_sync=[])
    assert in_sync(T0 + 100) == {"b:1", "c:1"} and stale.in_sync == ("b:1", "c:1")
    slave = beat(registry, "b:1", T0 + 100, offset=300, in_sync=[])
    assert in_sync(T0 + 100) == {"b:1", "c:1"} and slave.in_sync is None  # only the master is told
    current = beat(registry, "a:1", T0 + 200, offset=300, epoch=epoch, in_sync=["b:1"])
    assert in_sync(T0 + 200) == {"b:1"} and current.in_sync == ("b:1",)


def test_a_metaserver_that_heard_no_one_fails_no_master_over_for_its_own_silence() -> None:
    """Cut off (or frozen) itself, the metaserver hears nobody; at the heal a slave's heartbeat may
    come first: the master's silence was the metaserver's, so it keeps the group."""
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.expire(T0 + 3 * FAILOVER)  # nothing heard: nobody live to promote, the group waits
    first = beat(registry, "b:1", T0 + 3 * FAILOVER, offset=300)
    assert (first.role, first.master) == (Role.SLAVE, "a:1")
    assert [type(e).__name__ for e in registry.take_events()][-1] == "HeardAgain"
    assert beat(registry, "a:1", T0 + 3 * FAILOVER + 200, offset=300, in_sync=["b:1", "c:1"]).role is Role.MASTER
    # A master that really died is replaced a failover time after its last heartbeat, as ever.
    beat(registry, "b:1", T0 + 4 * FAILOVER, offset=300)
    beat(registry, "c:1", T0 + 4 * FAILOVER, offset=300)
    registry.expire(T0 + 4 * FAILOVER + 200)
    assert master_of(registry, T0 + 4 * FAILOVER + 200) == "b:1"
    assert registry.status(T0 + 4 * FAILOVER + 200)[0].epoch > epoch


def test_a_member_moving_to_a_new_address_keeps_its_standing() -> None:
    # Evicted after 2 s of silence, well before a failover (5 s): a member may move once evicted.
    registry = Registry(evict_after_ms=2_000, heartbeat_interval_ms=1_000, failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    beat(registry, "a:1", T0 + 1_000, offset=300, epoch=epoch, mode="sync", in_sync=["b:1", "c:1"])
    beat(registry, "c:1", T0 + 1_000, offset=200, epoch=epoch)
    # The slave b restarts on another port: refused while b:1 is live, then still a slave, still in sync.
    with pytest.raises(MemberTaken):
        registry.register(member("b:2", name="folder-b:1", offset=100, incarnation="run2"), now_ms=T0 + 1_999)
    moved = registry.register(member("b:2", name="folder-b:1", offset=100, incarnation="run2"), now_ms=T0 + 2_000)
    assert moved.role is Role.SLAVE and moved.epoch == epoch
    rows = {r.address: (r.role.value, r.in_sync, r.offset) for r in registry.status(T0 + 2_000)}
    assert rows == {"a:1": ("master", False, 300), "b:2": ("slave", True, 100), "c:1": ("slave", True, 200)}
    beat(registry, "b:2", T0 + 2_500, offset=100, epoch=epoch)
    beat(registry, "c:1", T0 + 2_500, offset=200, epoch=epoch)
    # The master restarts on another port: still master, a new epoch, routed there at once.
    master = registry.register(member("a:2", name="folder-a:1", incarnation="run2"), now_ms=T0 + 3_000)
    assert master.role is Role.MASTER and master.epoch is not None and master.epoch > epoch
    assert routed_master(registry, T0 + 3_000) == "a:2"
    assert sorted(r.address for r in registry.status(T0 + 3_000)) == ["a:2", "b:2", "c:1"]
    # Another data folder at a known address gets none of the old one's standing.
    stranger = registry.register(member("c:1", name="empty-folder"), now_ms=T0 + 3_500)
    assert stranger.role is Role.SLAVE
    assert {r.address: r.in_sync for r in registry.status(T0 + 3_500)}["c:1"] is False


def test_a_new_data_folder_at_the_masters_address_hands_the_group_to_an_in_sync_slave() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.take_events()
    reply = registry.register(member("a:1", name="empty-folder", incarnation="run2"), now_ms=T0 + 1_000)
    assert (reply.role, reply.master) == (Role.SLAVE, "c:1")  # c:1: in sync and furthest ahead
    assert reply.epoch is not None and reply.epoch > epoch
    (change,) = registry.take_events()
    assert isinstance(change, MasterChanged) and (change.old, change.new, change.reason) == (None, "c:1", "failover")


# -- failover ------------------------------------------------------------------------


def test_a_silent_master_is_replaced_by_the_in_sync_slave_furthest_ahead() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.register(member("d:1", offset=900), now_ms=T0)  # furthest ahead, but not in sync
    registry.take_events()
    for t in range(1_000, 10_001, 1_000):  # the slaves heartbeat; the master died at T0
        for address, offset in (("b:1", 100), ("c:1", 200), ("d:1", 900)):
            beat(registry, address, T0 + t, offset=offset, epoch=epoch)
        if t == 4_000:
            assert registry.expire(T0 + FAILOVER - 1) is False
            assert master_of(registry, T0 + FAILOVER - 1) == "a:1"
    # Promoted at the failover moment; routes moved with it.
    events = registry.take_events()
    assert len(events) == 1 and isinstance(events[0], MasterChanged)
    change = events[0]
    assert (change.old, change.new, change.reason, change.silent_ms, change.offset) == (
        "a:1",
        "c:1",
        "failover",
        FAILOVER,
        200,
    )
    assert change.epoch > epoch
    assert routed_master(registry, T0 + 10_000) == "c:1"
    # The deposed master, back, is told it is a slave of the new epoch: no error.
    deposed = beat(registry, "a:1", T0 + 10_500, offset=300, epoch=epoch, in_sync=["b:1", "c:1"])
    assert (deposed.role, deposed.master, deposed.epoch, deposed.handover_to) == (
        Role.SLAVE,
        "c:1",
        change.epoch,
        None,
    )
    again = registry.register(member("a:1", offset=300, epoch=epoch, in_sync=["b:1"]), now_ms=T0 + 11_000)
    assert (again.role, again.epoch) == (Role.SLAVE, change.epoch)
    assert master_of(registry, T0 + 11_000) == "c:1"
    assert {r.address: r.in_sync for r in registry.status(T0 + 11_000)}["b:1"] is False  # a slave's list counts not


def test_failover_happens_at_the_first_request_after_the_silence_without_expire() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    three_servers(registry)
    beat(registry, "b:1", T0 + 4_000, offset=100)
    assert routed_master(registry, T0 + FAILOVER - 1) == "a:1"
    assert routed_master(registry, T0 + FAILOVER) == "b:1"  # c:1 fell silent too: only b:1 may be promoted


def test_equal_offsets_promote_the_lowest_address() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    registry.register(member("m:1"), now_ms=T0)
    for address in ("z:1", "b:9", "k:1"):
        registry.register(member(address, offset=50), now_ms=T0)
    beat(registry, "m:1", T0, offset=50, in_sync=["z:1", "b:9", "k:1"])
    for address in ("z:1", "b:9", "k:1"):
        beat(registry, address, T0 + 4_000, offset=50)
    registry.expire(T0 + FAILOVER)
    assert master_of(registry, T0 + FAILOVER) == "b:9"


def test_without_an_eligible_slave_the_group_waits_for_its_master() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    first = registry.register(member("a:1"), now_ms=T0)
    registry.register(member("b:1", offset=500), now_ms=T0)  # never listed in sync
    beat(registry, "a:1", T0, offset=400, in_sync=[])
    registry.take_events()
    for t in range(1_000, 20_001, 1_000):
        beat(registry, "b:1", T0 + t, offset=500)
        registry.expire(T0 + t)
    assert master_of(registry, T0 + 20_000) == "a:1"
    assert registry.take_events() == [FailoverBlocked(GROUP, "a:1", FAILOVER, ())]  # once, not per check
    back = beat(registry, "a:1", T0 + 21_000, offset=400, in_sync=["b:1"])
    assert (back.role, back.epoch) == (Role.MASTER, first.epoch)  # the same term goes on
    assert registry.take_events() == []


def test_an_in_sync_slave_that_is_silent_too_is_promoted_a_failover_time_after_it_heartbeats_again() -> None:
    """Everyone silent looks like the metaserver's own silence: the master gets one more failover time."""
    registry = Registry(failover_after_ms=FAILOVER)
    three_servers(registry)
    registry.expire(T0 + 30_000 - 1)  # all silent: nobody to promote
    assert master_of(registry, T0 + 30_000 - 1) == "a:1"
    reply = beat(registry, "b:1", T0 + 29_000, offset=100)  # the clock never runs back: taken as the latest
    assert (reply.role, reply.master) == (Role.SLAVE, "a:1")
    for t in range(1_000, FAILOVER, 1_000):  # b heartbeats on; a stays silent
        beat(registry, "b:1", T0 + 30_000 + t, offset=100)
    reply = beat(registry, "b:1", T0 + 30_000 + FAILOVER, offset=100)
    assert (reply.role, reply.master) == (Role.MASTER, "b:1")


# -- graceful handover ---------------------------------------------------------------


def test_handover_promotes_the_target_when_the_master_reports_it_handed_over() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.take_events()
    handover = registry.handover(GROUP, now_ms=T0 + 100)  # default: the in-sync slave furthest ahead
    assert (handover.group, handover.epoch, handover.from_address, handover.to_address) == (GROUP, epoch, "a:1", "c:1")
    assert registry.handover(GROUP, "c:1", now_ms=T0 + 100) == handover  # asking again answers the same
    asked = beat(registry, "a:1", T0 + 200, offset=300, epoch=epoch, in_sync=["b:1", "c:1"])
    assert (asked.role, asked.handover_to) == (Role.MASTER, "c:1")
    assert beat(registry, "c:1", T0 + 200, offset=250, epoch=epoch).handover_to == "c:1"  # the target hurries
    assert beat(registry, "b:1", T0 + 200, offset=250, epoch=epoch).handover_to is None  # no other slave is told
    stale = beat(registry, "a:1", T0 + 300, offset=300, epoch=epoch, in_sync=["c:1"], handed_over=epoch - 1)
    assert stale.role is Role.MASTER  # another term's handover is not this one's
    done = beat(registry, "a:1", T0 + 400, offset=300, epoch=epoch, in_sync=["c:1"], handed_over=epoch)
    assert (done.role, done.master, done.handover_to) == (Role.SLAVE, "c:1", None)
    assert done.epoch is not None and done.epoch > epoch
    assert routed_master(registry, T0 + 400) == "c:1"
    rows = {r.address: (r.role.value, r.in_sync) for r in registry.status(T0 + 400)}
    assert rows == {"a:1": ("slave", True), "b:1": ("slave", False), "c:1": ("master", False)}
    change = registry.take_events()[-1]
    assert isinstance(change, MasterChanged)
    assert (change.old, change.new, change.reason, change.epoch) == ("a:1", "c:1", "handover", done.epoch)


@pytest.mark.parametrize(
    ("to", "field", "says"),
    [
        ("x:1", "to", "x:1 is not a server of group 'sched1'"),
        ("a:1", "to", "a:1 is already the master"),
        ("d:1", "to", "d:1 is not in sync with master a:1 of group 'sched1' (in sync: b:1, c:1)"),
        ("e:1", "to", "e:1 has not heartbeated for 6.0 s"),
        ("bad address", "to", "is not host:port"),
    ],
)
def test_handover_refuses_a_target_that_cannot_take_over(to: str, field: str, says: str) -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    registry.register(member("e:1"), now_ms=T0)  # the first: master; it hands over to a:1, then falls silent
    registry.register(member("a:1"), now_ms=T0)
    beat(registry, "e:1", T0, in_sync=["a:1"])
    registry.handover(GROUP, "a:1", now_ms=T0)
    beat(registry, "e:1", T0, in_sync=["a:1"], handed_over=registry.status(T0)[0].epoch)
    beat(registry, "a:1", T0 + 3_000)  # the metaserver hears the group: e:1's silence is its own
    now = T0 + 6_000
    registry.register(member("b:1", offset=100), now_ms=now)
    registry.register(member("c:1", offset=200), now_ms=now)
    registry.register(member("d:1", offset=900), now_ms=now)
    beat(registry, "a:1", now, in_sync=["b:1", "c:1"])
    assert master_of(registry, now) == "a:1"
    with pytest.raises(RegistryError) as refused:
        registry.handover(GROUP, to, now_ms=now)
    assert refused.value.field == field and says in str(refused.value)


def test_handover_refusals_name_the_group_or_the_missing_target() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    with pytest.raises(RegistryError, match="unknown group 'nope'") as unknown:
        registry.handover("nope", now_ms=T0)
    assert unknown.value.field == "group"
    registry.register(
        {"group": "rt1", "kind": "realtime", "role": "master", "address": "r:1", "software_version": "1"}, now_ms=T0
    )
    with pytest.raises(RegistryError, match="'rt1' is not replicated") as plain:
        registry.handover("rt1", now_ms=T0)
    assert plain.value.field == "group"
    registry.register(member("a:1"), now_ms=T0)
    registry.register(member("b:1"), now_ms=T0)
    with pytest.raises(RegistryError, match="no live in-sync slave to hand over to") as nobody:
        registry.handover(GROUP, now_ms=T0)
    assert nobody.value.field == "to"
    beat(registry, "a:1", T0, in_sync=["b:1"])
    registry.register(member("c:1"), now_ms=T0)
    beat(registry, "a:1", T0, in_sync=["b:1", "c:1"])
    registry.handover(GROUP, "b:1", now_ms=T0)
    with pytest.raises(RegistryError, match="a handover of group 'sched1' to b:1 is pending") as pending:
        registry.handover(GROUP, "c:1", now_ms=T0)
    assert pending.value.field == "to"
    with pytest.raises(RegistryError, match=r"no live master to hand over from \(a:1 silent for 5.0 s\)") as dead:
        registry.handover(GROUP, now_ms=T0 + FAILOVER)
    assert dead.value.field == "group"


def test_a_pending_handover_is_dropped_when_its_target_falls_silent_or_the_master_changes() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.handover(GROUP, "b:1", now_ms=T0)
    registry.take_events()
    beat(registry, "c:1", T0 + 4_000, offset=200)
    beat(registry, "a:1", T0 + 4_000, offset=300, epoch=epoch, in_sync=["b:1", "c:1"])
    reply = beat(registry, "a:1", T0 + 5_000, offset=300, epoch=epoch, in_sync=["b:1", "c:1"])
    assert (reply.role, reply.handover_to) == (Role.MASTER, None)  # b:1 is silent: the master resumes
    assert registry.take_events() == [HandoverDropped(GROUP, "b:1", "it has not heartbeated for 5.0 s")]
    registry.handover(GROUP, "c:1", now_ms=T0 + 5_000)  # another target may be asked now
    beat(registry, "c:1", T0 + 9_000, offset=200)
    registry.expire(T0 + 10_000)  # the master dies while handing over: failover to the target anyway
    events = registry.take_events()
    assert events[0] == HandoverDropped(GROUP, "c:1", "the master changed (failover)")
    assert isinstance(events[1], MasterChanged) and events[1].new == "c:1"
    assert beat(registry, "c:1", T0 + 10_000).handover_to is None


# -- snapshots -----------------------------------------------------------------------


def test_a_snapshot_keeps_epochs_members_offsets_and_the_in_sync_list() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    epoch = three_servers(registry)
    registry.handover(GROUP, "c:1", now_ms=T0)
    snapshot = msgpack.unpackb(msgpack.packb(registry.snapshot()))
    assert snapshot["format"] == 3
    group = snapshot["groups"][0]
    assert (group["managed"], group["epoch"], group["master"], group["in_sync"], group["handover_to"]) == (
        True,
        epoch,
        "a:1",
        ["b:1", "c:1"],
        "c:1",
    )
    assert [(s["address"], s["member"], s["offset"]) for s in group["servers"]] == [
        ("a:1", "folder-a:1", 300),
        ("b:1", "folder-b:1", 100),
        ("c:1", "folder-c:1", 200),
    ]
    restored = Registry.restore(snapshot, T0 + 60_000, failover_after_ms=FAILOVER)
    assert restored.snapshot()["groups"] == snapshot["groups"]
    assert beat(restored, "b:1", T0 + 60_000).epoch == epoch  # kept, not bumped, by the restore
    # Every server got a full grace: the master's silence counts from the restore.
    assert master_of(restored, T0 + 60_000 + FAILOVER - 1) == "a:1"
    beat(restored, "c:1", T0 + 60_000 + 4_000, offset=200)
    assert master_of(restored, T0 + 60_000 + FAILOVER) == "c:1"


def test_a_registry_restored_from_an_old_snapshot_never_hands_out_an_epoch_again() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    three_servers(registry)
    old = registry.snapshot()
    issued = set()
    for n in range(2, 5):  # three more terms (restarts of the master), never persisted
        issued.add(registry.register(member("a:1", incarnation=f"run{n}"), now_ms=T0 + n).epoch)
    restored = Registry.restore(old, T0 + 10, failover_after_ms=FAILOVER)
    reply = restored.register(member("a:1", incarnation="run9"), now_ms=T0 + 10)
    assert reply.epoch is not None and reply.epoch > max(e for e in issued if e is not None)


def test_an_epoch_a_member_holds_is_never_handed_out_again_even_by_an_empty_metaserver() -> None:
    registry = Registry(failover_after_ms=FAILOVER)
    reply = registry.register(member("a:1", epoch=T0 + 50_000), now_ms=T0)  # it held a later epoch than our clock
    assert reply.epoch == T0 + 50_001


def test_a_format_2_snapshot_restores_groups_as_not_managed() -> None:
    registry = Registry()
    registry.register(
        {"group": "rt1", "kind": "realtime", "role": "master", "address": "r:1", "software_version": "1"}, now_ms=T0
    )
    snapshot = registry.snapshot()
    snapshot["format"] = 2
    for group in snapshot["groups"]:
        for key in ("managed", "epoch", "master", "in_sync", "handover_to"):
            del group[key]
        for server in group["servers"]:
            del server["member"], server["offset"]
    restored = Registry.restore(snapshot, T0)
    reply = restored.register(
        {"group": "rt1", "kind": "realtime", "role": "master", "address": "r:1", "software_version": "1"}, now_ms=T0
    )
    assert (reply.master, reply.role, reply.epoch) == ("r:1", None, None)
    assert restored.snapshot()["groups"][0]["managed"] is False


@pytest.mark.parametrize(
    ("damage", "field"),
    [
        (lambda g: g.update(epoch=-1), "snapshot.groups[0].epoch"),
        (lambda g: g.update(managed="yes"), "snapshot.groups[0].managed"),
        (lambda g: g.update(master="b:1"), "snapshot.groups[0].master"),
        (lambda g: g.update(in_sync=["nohost"]), "snapshot.groups[0].in_sync[0]"),
        (lambda g: g["servers"][0].update(offset="7"), "snapshot.groups[0].servers[0].offset"),
        (lambda g: g["servers"][0].update(member="m" * 65), "snapshot.groups[0].servers[0].member"),
    ],
)
def test_restore_refuses_damaged_managed_fields_naming_them(damage: Any, field: str) -> None:
    registry = Registry()
    three_servers(registry)
    snapshot = registry.snapshot()
    damage(snapshot["groups"][0])
    with pytest.raises(RegistryError) as refused:
        Registry.restore(snapshot, T0)
    assert refused.value.field == field


# -- validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replica", "field"),
    [
        ("offset 7", "replica"),
        ({"epoch": 0}, "replica.offset"),
        ({"offset": 0}, "replica.epoch"),
        ({"offset": -1, "epoch": 0}, "replica.offset"),
        ({"offset": 2**63, "epoch": 0}, "replica.offset"),
        ({"offset": 0, "epoch": True}, "replica.epoch"),
        ({"offset": 0, "epoch": 0, "mode": "fast"}, "replica.mode"),
        ({"offset": 0, "epoch": 0, "in_sync": "b:1"}, "replica.in_sync"),
        ({"offset": 0, "epoch": 0, "in_sync": ["b:1", "nohost"]}, "replica.in_sync[1]"),
        ({"offset": 0, "epoch": 0, "in_sync": [f"h{n}:1" for n in range(65)]}, "replica.in_sync"),
        ({"offset": 0, "epoch": 0, "handed_over": -2}, "replica.handed_over"),
    ],
)
def test_bad_replica_reports_are_refused_naming_the_field(replica: Any, field: str) -> None:
    registry = Registry()
    with pytest.raises(RegistryError) as refused:
        registry.register({**member("a:1"), "replica": replica}, now_ms=T0)
    assert refused.value.field == field
    registry.register(member("a:1"), now_ms=T0)
    with pytest.raises(RegistryError) as refused:
        registry.heartbeat(GROUP, "a:1", now_ms=T0, replica=replica)
    assert refused.value.field == field


def test_member_ids_and_the_failover_time_are_checked() -> None:
    with pytest.raises(RegistryError) as refused:
        Registry().register(member("a:1", name="m" * 65), now_ms=T0)
    assert refused.value.field == "member" and "limit 64" in str(refused.value)
    with pytest.raises(RegistryError) as too_short:
        Registry(failover_after_ms=4)
    assert too_short.value.field == "failover_after_ms"
    assert Registry(failover_after_ms=5).register(member("a:1"), now_ms=T0).heartbeat_interval_ms == 1
