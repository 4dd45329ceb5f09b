"""CANCEL, MOVE, QUERY and duplicate SCHEDULEs on a real scheduler (docs/cancel.md).

Every server is real, on the in-memory network of ``conftest.py``, under
``autojump_clock``: a day of schedule takes milliseconds.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import encode_message, new_message_id
from delaymq.scheduler.cancels import RecentDispatches
from delaymq.wheel import HOUR_MS

from ..support.polling import wait_until

SECOND = 1_000
MINUTE = 60_000
DAY = 86_400_000
# Quiet periodic tasks, so the clock jumps days in a few thousand steps.
QUIET = {
    "meta": {
        "heartbeat_interval_ms": DAY,
        "evict_after_ms": 3 * DAY,
        "check_interval_ms": DAY,
        "failover_after_ms": 5 * DAY,
    },
    "scheduler": {"cleanup_interval_ms": DAY},
    "rt_checkpoint_ms": DAY,
}


def keyed(name: str, at: int, key: str | None = None, subject: str = "orders") -> bytes:
    return encode_message(
        name, subject, body=name.encode(), deliver_at=at, created_at=at, properties={"key": key} if key else None
    )


async def call(cluster: Any, command: Command, metadata: dict[str, Any]) -> list[dict[str, Any]]:
    frame = await cluster.net.call(cluster_address(cluster), command, metadata)
    results: list[dict[str, Any]] = frame.metadata["results"]
    return results


def cluster_address(cluster: Any) -> str:
    return getattr(cluster, "address", "scheduler.test:1")


def by_id(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in results}


async def test_cancel_by_id_and_by_key_only_the_others_arrive_on_time(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        plan = {f"m{i}": now + 10 * SECOND + i * 997 for i in range(60)}
        keys = {name: f"order-{i % 6}" for i, name in enumerate(plan)}  # order-0: m0, m6, ...
        async with cluster.scheduler() as scheduler:
            frame = await cluster.schedule_raw([keyed(n, at, keys[n]) for n, at in plan.items()])
            assert frame.metadata["results"] == ["scheduled"] * 60
            assert frame.metadata["group"] == scheduler.group
            by_ids = ["m1", "m2", "m3", "m40"]
            answered = by_id(await call(cluster, Command.CANCEL, {"ids": [*by_ids, "never-sent"]}))
            assert {k: v["state"] for k, v in answered.items()} == {
                **dict.fromkeys(by_ids, "cancelled"),
                "never-sent": "unknown",
            }
            assert answered["m40"]["deliver_at"] == plan["m40"]
            keyed_ids = {n for n, k in keys.items() if k == "order-0"}
            answered = by_id(await call(cluster, Command.CANCEL, {"subject": "orders", "key": "order-0"}))
            assert set(answered) == keyed_ids and {r["state"] for r in answered.values()} == {"cancelled"}
            # Asked again: still cancelled, never delivered.
            again = by_id(await call(cluster, Command.CANCEL, {"ids": ["m1"]}))
            assert again["m1"]["state"] == "cancelled"
            cancelled = set(by_ids) | keyed_ids
            await receiver.wait_for(len(plan) - len(cancelled))
            await cluster.clock.sleep_until_ms(max(plan.values()) + 5 * SECOND)
            got = Counter(receiver.ids())
            assert set(got) == set(plan) - cancelled and max(got.values()) == 1
            assert all(0 <= r.received_at - r.deliver_at <= 2 for r in receiver.got)  # on time
            states = by_id(await call(cluster, Command.QUERY, {"ids": ["m1", "m5", "nope"]}))
            assert states["m1"]["state"] == "cancelled" and states["m5"]["state"] == "delivered"
            assert states["nope"] == {"id": "nope", "state": "unknown"}
            assert scheduler.statistics().pending == 0


async def test_cancel_after_delivery_is_answered_delivered_with_when(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler():
            await cluster.schedule_raw([keyed("late", now + 2 * SECOND, "k")])
            await receiver.wait_for(1)
            await trio.sleep(1)  # the dispatch log has it
            answered = (await call(cluster, Command.CANCEL, {"subject": "orders", "key": "k"}))[0]
            assert answered["state"] == "delivered"
            assert answered["deliver_at"] == now + 2 * SECOND
            assert answered["deliver_at"] <= answered["dispatched_at"] <= receiver.got[0].received_at
            moved = (await call(cluster, Command.MOVE, {"ids": ["late"], "deliver_at": now + HOUR_MS}))[0]
            assert moved["state"] == "delivered"
            queried = (await call(cluster, Command.QUERY, {"ids": ["late"]}))[0]
            assert queried["state"] == "delivered" and queried["hour"] == (now + 2 * SECOND) // HOUR_MS


@pytest.mark.parametrize(
    "first, then",
    [
        (2 * HOUR_MS, 10 * SECOND),  # earlier, across hours
        (30 * MINUTE, 26 * HOUR_MS + 5 * SECOND),  # later, across a day
        (3 * 86_400_000, 20 * SECOND),  # earlier, across days
        (10 * SECOND, 40 * SECOND),  # later, same hour
    ],
    ids=["earlier-hours", "later-day", "earlier-days", "later-same-hour"],
)
async def test_move_delivers_once_at_the_new_time_with_id_and_body(
    sched: Any, tmp_path: Path, autojump_clock: Any, first: int, then: int
) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler() as scheduler:
            await cluster.schedule_raw([keyed("trip", now + first, "flight-7"), keyed("other", now + first)])
            moved = await call(
                cluster, Command.MOVE, {"subject": "orders", "key": "flight-7", "deliver_at": now + then}
            )
            assert moved == [{"id": "trip", "state": "moved", "deliver_at": now + then}]
            queried = by_id(await call(cluster, Command.QUERY, {"ids": ["trip"]}))["trip"]
            assert queried["state"] == "scheduled" and queried["deliver_at"] == now + then
            assert queried["hour"] == (now + then) // HOUR_MS and queried["group"] == scheduler.group
            await receiver.wait_for(2)
            await cluster.clock.sleep_until_ms(now + max(first, then) + MINUTE)
        got = {r.id: r for r in receiver.got}
        assert Counter(receiver.ids()) == {"trip": 1, "other": 1}
        assert 0 <= got["trip"].received_at - (now + then) <= 2
        assert got["trip"].deliver_at == now + then


async def test_a_cancel_survives_a_restart_and_a_kill(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path, **QUIET) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        names = [f"r{i}" for i in range(6)]
        async with cluster.scheduler():
            await cluster.schedule_raw([keyed(n, now + HOUR_MS + i * SECOND) for i, n in enumerate(names)])
            assert {r["state"] for r in await call(cluster, Command.CANCEL, {"ids": ["r0", "r1"]})} == {"cancelled"}
        # Stopped cleanly, started again: still cancelled.
        async with cluster.scheduler():
            states = by_id(await call(cluster, Command.QUERY, {"ids": names}))
            assert [states[n]["state"] for n in names] == ["cancelled"] * 2 + ["scheduled"] * 4
        # Killed right after the answer (nothing more written, as SIGKILL), the folder opened again.
        async with cluster.scheduler() as scheduler:
            moved = await call(cluster, Command.MOVE, {"ids": ["r2"], "deliver_at": now + 2 * HOUR_MS})
            assert moved[0]["state"] == "moved"
            assert (await call(cluster, Command.CANCEL, {"ids": ["r3"]}))[0]["state"] == "cancelled"
            scheduler.crash()
            await trio.sleep_forever()
        async with cluster.scheduler() as restarted:
            states = by_id(await call(cluster, Command.QUERY, {"ids": names}))
            assert [states[n]["state"] for n in names] == ["cancelled"] * 2 + ["scheduled", "cancelled"] * 1 + [
                "scheduled"
            ] * 2
            assert states["r2"]["deliver_at"] == now + 2 * HOUR_MS
            await receiver.wait_for(3)
            await cluster.clock.sleep_until_ms(now + 2 * HOUR_MS + MINUTE)
            assert restarted.statistics().pending == 0
        assert sorted(receiver.ids()) == ["r2", "r4", "r5"]


async def test_a_cancel_of_an_id_not_yet_filed_is_kept(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path, scheduler={"flush": "async"}) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        async with cluster.scheduler() as scheduler:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    cluster.schedule_raw, [keyed("quick", now + 3 * SECOND), keyed("stays", now + 3 * SECOND)]
                )
                await trio.lowlevel.checkpoint()
                while "quick" not in scheduler.session.tail.ids:  # type: ignore[union-attr]
                    await trio.lowlevel.checkpoint()
                assert scheduler.store.checkpoint == 0  # not filed yet
                answered = await call(cluster, Command.CANCEL, {"ids": ["quick"]})
            assert answered[0]["state"] == "cancelled"
            await receiver.wait_for(1)
            await cluster.clock.sleep_until_ms(now + 10 * SECOND)
        assert receiver.ids() == ["stays"]


async def test_a_retried_schedule_is_stored_once(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        batch = [keyed(f"d{i}", now + 5 * SECOND + i, f"k{i}") for i in range(50)]
        async with cluster.scheduler() as scheduler:
            answers: list[list[str]] = []

            async def schedule() -> None:
                answers.append((await cluster.schedule_raw(batch)).metadata["results"])

            async with trio.open_nursery() as nursery:  # at once: the second sees the first being appended
                nursery.start_soon(schedule)
                nursery.start_soon(schedule)
            await schedule()  # later: the first is filed by now
            assert sorted(map(tuple, answers)) == [("duplicate",) * 50] * 2 + [("scheduled",) * 50]
            twice = (await cluster.schedule_raw([keyed("x", now + 5 * SECOND)] * 2)).metadata["results"]
            assert twice == ["scheduled", "duplicate"]  # the same id twice in one batch
            await receiver.wait_for(51)
            await cluster.clock.sleep_until_ms(now + 20 * SECOND)
            stats = scheduler.statistics()
        assert Counter(receiver.ids()) == Counter([f"d{i}" for i in range(50)] + ["x"])
        assert cluster.realtime["rt1"].statistics().duplicates == 0  # never sent twice either
        assert stats.scheduled == 51 and stats.pending == 0
        # Once delivered, the same id may be scheduled again (a new message).
        async with cluster.scheduler():
            again = await cluster.schedule_raw([keyed("d0", now + 30 * SECOND)])
            assert again.metadata["results"] == ["scheduled"]


async def test_new_time_ordered_ids_skip_the_index_read_and_stored_ones_are_still_duplicates(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    # Ids made now sort past every id the index holds: the scheduler knows them new without
    # reading it. A batch holding one stored id among newer ones reads it, and refuses that one.
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        ids = [new_message_id(now) for _ in range(30)]
        first = [keyed(i, now + 60 * SECOND) for i in ids[:20]]
        async with cluster.scheduler() as scheduler:
            answered = (await cluster.schedule_raw(first)).metadata["results"]
            assert answered == ["scheduled"] * 20
            while scheduler.store.checkpoint < scheduler.member.log.end_offset:
                await scheduler.session.step_filed.wait()  # a new event each step: read it again
            assert not scheduler.session.tail.ids  # filed: only the index knows them now
            newer = [keyed(i, now + 60 * SECOND) for i in ids[20:]]
            assert scheduler.store.past_every_indexed(ids[20:])
            assert not scheduler.store.past_every_indexed([ids[19], *ids[20:]])
            mixed = (await cluster.schedule_raw([*newer[:5], first[19], *newer[5:]])).metadata["results"]
            assert mixed == ["scheduled"] * 5 + ["duplicate"] + ["scheduled"] * 5
            again = (await cluster.schedule_raw(first[:3])).metadata["results"]
            assert again == ["duplicate"] * 3
            # A new id twice in one batch: none indexed, and still stored once.
            twice = keyed(new_message_id(now), now + 60 * SECOND)
            assert scheduler.store.past_every_indexed([new_message_id(now)])
            assert (await cluster.schedule_raw([twice, twice])).metadata["results"] == ["scheduled", "duplicate"]
            stats = scheduler.statistics()
        assert stats.scheduled == 31


BAD_METADATA = [
    (Command.CANCEL, {}, "ids"),
    (Command.CANCEL, {"ids": ["a"], "subject": "orders", "key": "k"}, "ids"),
    (Command.CANCEL, {"ids": "a"}, "ids"),
    (Command.CANCEL, {"ids": []}, "ids"),
    (Command.CANCEL, {"ids": [f"i{n}" for n in range(1001)]}, "ids"),
    (Command.CANCEL, {"ids": ["ok", 7]}, "ids[1]"),
    (Command.CANCEL, {"subject": "orders"}, "key"),
    (Command.QUERY, {"subject": "orders", "key": "k" * 257}, "key"),
    (Command.QUERY, {"subject": "orders", "key": "bad\x01key"}, "key"),
    (Command.QUERY, {"ids": ["a"], "deliver_at": 5}, "deliver_at"),
    (Command.CANCEL, {"ids": ["a"], "colour": "red"}, "colour"),
    (Command.MOVE, {"ids": ["a"]}, "deliver_at"),
    (Command.MOVE, {"ids": ["a"], "deliver_at": "soon"}, "deliver_at"),
    (Command.MOVE, {"ids": ["a"], "deliver_at": 10**15}, "deliver_at"),
]


async def test_bad_metadata_is_refused_naming_the_field(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler():
        for command, metadata, field in BAD_METADATA:
            with pytest.raises(PeerError) as refused:
                await cluster.net.call(sched.SCHEDULER, command, metadata)
            assert (refused.value.code, refused.value.field) == ("bad_request", field), (command, metadata)
        assert refused.value.limit == 732 * DAY  # the horizon, for the last one


async def test_a_bad_key_property_refuses_the_schedule(sched: Any, tmp_path: Path, autojump_clock: Any) -> None:
    async with sched.open_cluster(tmp_path) as cluster, cluster.scheduler():
        now = cluster.clock.now_ms()
        with pytest.raises(PeerError) as refused:
            await cluster.schedule_raw([keyed("fine", now + SECOND, "k"), keyed("long", now + SECOND, "x" * 300)])
        assert (refused.value.field, refused.value.limit, refused.value.index) == ("key", 256, 1)


@pytest.mark.parametrize("send_ahead_ms", [0, 50])
@pytest.mark.parametrize("offset_ms", [-3, 0, 3])
async def test_a_cancel_racing_the_firing_second_is_either_delivered_or_cancelled_never_both(
    sched: Any, tmp_path: Path, autojump_clock: Any, offset_ms: int, send_ahead_ms: int
) -> None:
    """Each message gets a cancel sent at the millisecond it fires (its own, or ``send_ahead_ms``
    before it; give or take ``offset_ms`` and a spread): the answer says which won, and the
    consumer agrees."""
    async with sched.open_cluster(tmp_path) as cluster:
        now = cluster.clock.now_ms()
        receiver = cluster.receiver()
        due = {f"race{i}": now + 5 * SECOND + i * 7 for i in range(150)}
        answers: dict[str, str] = {}
        async with cluster.scheduler(send_ahead_ms=send_ahead_ms):
            await cluster.schedule_raw([keyed(n, at) for n, at in due.items()])

            async def cancel_at(name: str, at: int) -> None:
                await cluster.clock.sleep_until_ms(at)
                answers[name] = (await call(cluster, Command.CANCEL, {"ids": [name]}))[0]["state"]

            async with trio.open_nursery() as nursery:
                for i, (name, at) in enumerate(due.items()):
                    nursery.start_soon(cancel_at, name, at - send_ahead_ms + offset_ms + (i % 5) - 2)
            await cluster.clock.sleep_until_ms(max(due.values()) + 10 * SECOND)
            got = Counter(receiver.ids())
        assert max(got.values(), default=1) == 1
        assert all(r.received_at >= r.deliver_at for r in receiver.got)  # sent ahead or not, never early
        delivered = {name for name, state in answers.items() if state == "delivered"}
        cancelled = {name for name, state in answers.items() if state == "cancelled"}
        assert delivered | cancelled == set(due)  # every answer is one of the two
        assert set(got) == delivered  # delivered: it arrived; cancelled: it never did
        if offset_ms >= 3:
            assert delivered == set(due)  # the cancel came after the moment: too late for all
        if offset_ms <= -3:
            assert cancelled == set(due)  # before the moment: in time for all
        if offset_ms == 0:
            assert delivered and cancelled  # around the moment: both outcomes happen


A, B = "sched-a.test:1", "sched-b.test:1"


async def test_a_cancel_on_the_master_is_honoured_by_a_promoted_slave(
    sched: Any, tmp_path: Path, autojump_clock: Any
) -> None:
    async with sched.open_cluster(tmp_path, meta={"failover_after_ms": 5_000}) as cluster:
        receiver = cluster.receiver()
        master = await cluster.start_member(A, min_insync=1)
        slave = await cluster.start_member(B, min_insync=1)
        await wait_until(lambda: master.role == "master" and slave.role == "slave")
        await wait_until(lambda: master.replica_info().get("in_sync") == [B])
        now = cluster.clock.now_ms()
        names = [f"p{i}" for i in range(40)]
        due = {n: now + 20 * SECOND + i * 101 for i, n in enumerate(names)}
        frame = await cluster.net.call(
            A, Command.SCHEDULE, {}, b"".join(keyed(n, at, f"k{i % 4}") for i, (n, at) in enumerate(due.items()))
        )
        assert frame.metadata["group"] == master.group
        cancelled = {
            r["id"]
            for r in (await cluster.net.call(A, Command.CANCEL, {"subject": "orders", "key": "k1"})).metadata["results"]
        }
        assert cancelled == {n for i, n in enumerate(names) if i % 4 == 1}
        moved = (await cluster.net.call(A, Command.MOVE, {"ids": ["p0"], "deliver_at": now + 40 * SECOND})).metadata
        assert moved["results"][0]["state"] == "moved"
        master.crash()  # right after the answers: the slave holds the records (min_insync=1)
        cluster.net.remove(A)
        await wait_until(lambda: slave.role == "master")
        states = by_id((await cluster.net.call(B, Command.QUERY, {"ids": names})).metadata["results"])
        assert {n for n, r in states.items() if r["state"] == "cancelled"} == cancelled
        assert states["p0"]["deliver_at"] == now + 40 * SECOND
        await receiver.wait_for(len(names) - len(cancelled))
        await cluster.clock.sleep_until_ms(now + 50 * SECOND)
        got = {r.id: r for r in receiver.got}
        assert set(got) == set(names) - cancelled and len(receiver.got) == len(got)
        assert got["p0"].received_at >= now + 40 * SECOND


def test_filed_cancels_are_done_entries_of_their_hours_without_a_dispatch_log(tmp_path: Path) -> None:
    """A CANCEL of ids in many hours files with the step's lmdb commit (no dispatch log, no
    fsync per hour); the hours count them done, after a reopen too; deleting an hour forgets
    them; a cut-back of the cancel record (a tail the master never had) gives them back."""
    from delaymq.scheduler.idcutback import drop_from
    from delaymq.scheduler.idindex import cancel_record
    from delaymq.scheduler.replay import replay_until_caught_up
    from delaymq.scheduler.schedulelog import ScheduleStore
    from delaymq.storage.log import SegmentedLog
    from delaymq.storage.state import StateStore

    start = 1_767_304_800_000
    hours = 40
    names = [f"m{h}-{i}" for h in range(hours) for i in range(3)]
    at = {name: start + int(name[1:].split("-")[0]) * HOUR_MS + 1_000 * int(name.split("-")[1]) for name in names}
    gone = [f"m{h}-1" for h in range(hours)] + ["m0-2"]
    with SegmentedLog.open(tmp_path / "messages") as log, StateStore.open(tmp_path / "state") as state:
        log.append(b"".join(keyed(name, at[name], key=f"k{name}") for name in names))
        cancel_at = log.end_offset
        log.append(cancel_record(gone, taken_at=start))
        log.flush()
        with ScheduleStore.open(tmp_path / "schedule", state) as store:
            step = replay_until_caught_up(log, store)
            assert sum(map(len, step.cancelled.values())) == len(gone)
            first = start // HOUR_MS
            assert store.pending(first) == 1 and store.delivered(first) == {1, 2}
            assert all(store.pending(first + h) == 2 for h in range(1, hours))
            assert not list((tmp_path / "schedule").glob("*.dispatch"))
            store.record_dispatched(first, [0])  # the last one of the hour delivered: complete
            assert store.is_complete(first) and store.dispatched_count(first) == 3
        with ScheduleStore.open(tmp_path / "schedule", state) as store:  # what a restart sees
            assert store.delivered(first + 5) == {1}
            assert store.undispatched_hours() == [first + h for h in range(1, hours)]
            store.delete_hour(first)
            assert store.cancelled(first) == []
            assert store.cancelled(first + 5) == [1]
        drop_from(state, cancel_at, tmp_path / "schedule")  # the CANCEL record cut: its entries are scheduled again
        with ScheduleStore.open(tmp_path / "schedule", state) as store:
            assert store.cancelled(first + 5) == [] and store.pending(first + 5) == 3


def test_recent_dispatches_remember_at_least_the_latest_size_and_let_the_oldest_go() -> None:
    """``dispatched_at`` of a cancel that came too late: known for the latest dispatches."""
    recent = RecentDispatches(size=100)
    for n in range(10):
        recent.recorded({7: list(range(n * 30, n * 30 + 30)), 8: [n]}, 1_000 + n)
    assert recent.get(7, 299) == 1_009 and recent.get(8, 9) == 1_009
    assert recent.get(7, 270 - 1) == 1_008  # of the latest 100: kept
    assert all(recent.get(7, entry) is None for entry in range(60))  # the oldest: let go
    kept = sum(recent.get(7, entry) is not None for entry in range(300)) + sum(
        recent.get(8, n) is not None for n in range(10)
    )
    assert 100 <= kept <= 125
