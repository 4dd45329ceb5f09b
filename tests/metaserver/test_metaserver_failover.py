"""Failover and handover of managed groups through the networked metaserver.

Servers are registration agents (``run_registration`` with a ``replica`` report)
on an in-memory network, under ``autojump_clock``; a server "dies" when its agent
is cancelled, as a SIGKILLed process stops heartbeating.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.registration import Registration, run_registration
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError

META = "meta:20880"
GROUP = "sched1"
A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"
FAILOVER_MS = 5_000


@dataclass
class Copy:
    """A server's replica state, as its ``replica()`` callable reports it."""

    offset: int = 0
    epoch: int = 0  # 0: the epoch the metaserver last named (a server holds the one it was told)
    in_sync: tuple[str, ...] = ()
    handed_over: int | None = None
    registration: Registration | None = None

    def report(self) -> dict[str, Any]:
        epoch = self.epoch or (self.registration.epoch if self.registration is not None else 0)
        report: dict[str, Any] = {"offset": self.offset, "epoch": epoch, "mode": "sync"}
        report["in_sync"] = list(self.in_sync)
        if self.handed_over is not None:
            report["handed_over"] = self.handed_over
        return report


@dataclass
class Member:
    """A running registration agent; ``kill()`` stops it dead."""

    registration: Registration
    scope: trio.CancelScope

    def kill(self) -> None:
        self.scope.cancel()


async def start_member(
    nursery: trio.Nursery,
    network: MemoryNetwork,
    metaservers: Any,
    address: str,
    copy: Copy,
    *,
    incarnation: str | None = None,
    interval_ms: int | None = None,
) -> Member:
    info = {"group": GROUP, "kind": "scheduler", "role": "master", "address": address, "version": "0.1.0"}
    info["member"] = f"folder-{address}"
    if incarnation is not None:
        info["incarnation"] = incarnation
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[Registration]) -> None:
        with scope:
            await run_registration(
                network,
                meta_address=META,
                info=info,
                clock=metaservers.clock,
                interval_ms=interval_ms,
                replica=copy.report,
                task_status=task_status,
            )

    registration: Registration = await nursery.start(run)
    copy.registration = registration
    return Member(registration, scope)


async def status_rows(network: MemoryNetwork) -> dict[str, dict[str, Any]]:
    answer = (await network.call(META, Command.STATUS, {})).metadata
    return {row["address"]: row for row in answer["rows"] if row["group"] == GROUP}


async def became(registration: Registration, role: str) -> int:
    """Wait (at most a minute of mock time) until ``registration`` is told ``role``; its epoch then."""
    with trio.fail_after(60):
        view = registration.view()
        while view.role != role:
            view = await registration.wait_view_change(view)
    return view.epoch


async def recorded(registration: Registration, *members: str) -> None:
    """Wait (at most a minute of mock time) until the metaserver answers the master that it recorded ``members`` in sync."""
    with trio.fail_after(60):
        seen: tuple[int, tuple[str, ...] | None] = (0, None)
        while seen[1] != members:
            seen = await registration.wait_in_sync_change(seen)


async def test_a_silent_master_fails_over_at_its_deadline_written_and_logged_before_anyone_asks(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    clock = metaservers.clock
    # Evictions are looked for every 10 s: only the failover deadline can wake the expiry task in time.
    async with metaservers.on_network(check_interval_ms=10_000, failover_after_ms=FAILOVER_MS) as (
        meta,
        network,
        nursery,
    ):
        a = await start_member(nursery, network, metaservers, A, Copy(offset=300, in_sync=(B,)))
        b_copy = Copy(offset=300)
        b = await start_member(nursery, network, metaservers, B, b_copy, interval_ms=4_000)
        assert (a.registration.role, b.registration.role) == ("master", "slave")
        assert a.registration.heartbeat_interval_ms == FAILOVER_MS // 5
        first = a.registration.epoch
        assert first >= 1 and b.registration.epoch == first
        await clock.sleep_ms(2_500)
        a.kill()  # its last heartbeat was answered at +2 s; b heartbeats at +4 s and +8 s
        deadline = a.registration.last_answer_ms + FAILOVER_MS
        await clock.sleep_until_ms(deadline - 1)
        assert "failed over" not in caplog.text
        written = meta.statistics().snapshots_written
        await clock.sleep_until_ms(deadline + 1)
        assert (
            f"group {GROUP} failed over: master {A} silent for {FAILOVER_MS / 1000:.1f} s; promoted {B} (offset 300)"
            in caplog.text
        )
        assert meta.statistics().snapshots_written == written + 1  # written as soon as it happened
        epoch = await became(b.registration, "master")  # at b's next heartbeat
        assert epoch > first and b.registration.is_master
        rows = await status_rows(network)
        assert {address: (row["role"], row["epoch"]) for address, row in rows.items()} == {
            A: ("slave", epoch),
            B: ("master", epoch),
        }
        route = (await network.call(META, Command.ROUTE, {"route": "delayed-producer"})).metadata
        assert [g["address"] for g in route["groups"]] == [B]

        # The old master wakes up (a frozen process: the same run): it is told it is a slave.
        again = await start_member(nursery, network, metaservers, A, Copy(offset=300, in_sync=(B,)))
        assert (again.registration.role, again.registration.master_address, again.registration.epoch) == (
            "slave",
            B,
            epoch,
        )
        assert not again.registration.is_master and again.registration.statistics().failures == 0


async def test_no_promotion_without_an_in_sync_slave_is_logged_once(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        a = await start_member(nursery, network, metaservers, A, Copy(offset=100))
        b = await start_member(nursery, network, metaservers, B, Copy(offset=900))  # ahead, but never in sync
        a.kill()
        await metaservers.clock.sleep_ms(60_000)
        assert b.registration.role == "slave" and b.registration.master_address == A
        assert caplog.text.count("no live in-sync slave may replace it") == 1
        assert "the group waits for its master" in caplog.text


async def test_handover_over_the_wire_promotes_the_target_once_the_master_drained(
    autojump_clock: trio.testing.MockClock, metaservers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="delaymq.metaserver")
    clock = metaservers.clock
    async with metaservers.on_network(failover_after_ms=FAILOVER_MS) as (meta, network, nursery):
        a_copy = Copy(offset=500, in_sync=(B, C))
        a = await start_member(nursery, network, metaservers, A, a_copy)
        b_copy = Copy(offset=500)
        b = await start_member(nursery, network, metaservers, B, b_copy)
        await start_member(nursery, network, metaservers, C, Copy(offset=400))
        await recorded(a.registration, B, C)
        first = a.registration.epoch

        async def drain_when_asked() -> None:
            """The master's part: when told to hand over, it stops, drains, then says so at once."""
            view = a.registration.view()
            while view.handover_to is None:
                view = await a.registration.wait_view_change(view)
            a_copy.handed_over = view.epoch
            a.registration.heartbeat_now()

        nursery.start_soon(drain_when_asked)
        answer = (await network.call(META, Command.HANDOVER, {"group": GROUP})).metadata
        assert answer == {"group": GROUP, "epoch": first, "from": A, "to": B}  # B: in sync and furthest ahead
        asked = clock.monotonic_ms()
        assert await became(a.registration, "slave") > first
        assert clock.monotonic_ms() - asked <= FAILOVER_MS // 5  # told at its next heartbeat, answered at once
        assert a.registration.master_address == B
        b_copy.in_sync = (A,)  # the new master follows its own slaves from now on
        b.registration.heartbeat_now()
        epoch = await became(b.registration, "master")
        assert epoch == a.registration.epoch
        rows = await status_rows(network)
        assert {address: (row["role"], row["in_sync"]) for address, row in rows.items()} == {
            A: ("slave", True),
            B: ("master", False),
            C: ("slave", False),
        }
        assert f"group {GROUP}: handover from master {A} to {B} asked by" in caplog.text
        assert f"group {GROUP} handed over from {A} to {B} (offset 500) at epoch {epoch}" in caplog.text


@pytest.mark.parametrize(
    ("request_metadata", "field", "says"),
    [
        ({"group": "nope"}, "group", "unknown group 'nope'"),
        ({"group": "rt1"}, "group", "'rt1' is not replicated"),
        ({"group": GROUP, "to": "10.9.9.9:1"}, "to", "10.9.9.9:1 is not a server of group 'sched1'"),
        ({"group": GROUP, "to": B}, "to", f"{B} is not in sync with master {A}"),
        ({"group": GROUP, "to": 7}, "to", "must be str"),
        ({}, "group", "field 'group' is missing"),
    ],
)
async def test_handover_refusals_name_the_field(
    autojump_clock: trio.testing.MockClock,
    metaservers: Any,
    request_metadata: dict[str, Any],
    field: str,
    says: str,
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        await metaservers.start_agent(
            nursery, network, {"group": "rt1", "kind": "realtime", "role": "master", "address": C, "version": "1"}
        )
        await start_member(nursery, network, metaservers, A, Copy())
        await start_member(nursery, network, metaservers, B, Copy())
        with pytest.raises(PeerError) as refused:
            await network.call(META, Command.HANDOVER, request_metadata)
        assert (refused.value.code, refused.value.field) == ("bad_request", field)
        assert says in str(refused.value)


async def test_epochs_keep_going_up_across_metaserver_restarts(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.network() as (network, nursery):
        async with metaservers.serving(network) as meta:
            a = await start_member(nursery, network, metaservers, A, Copy(offset=10, in_sync=(B,)), incarnation="a1")
            b = await start_member(nursery, network, metaservers, B, Copy(offset=10), incarnation="b1")
            await recorded(a.registration, B)
            first = a.registration.epoch
            assert meta.statistics().snapshots_written >= 1
        # The metaserver restarts on its data folder; the servers ride the outage out.
        async with metaservers.serving(network) as meta:
            assert (await status_rows(network))[A]["epoch"] == first  # restored, not reissued
            assert meta.statistics().restored_servers == 2
            a.kill()
            second = await became(b.registration, "master")  # failover, after a full grace from the restart
            assert second > first
        async with metaservers.serving(network) as meta:
            rows = await status_rows(network)
            assert {address: (row["role"], row["epoch"]) for address, row in rows.items()} == {
                A: ("slave", second),
                B: ("master", second),
            }
            # The master restarts (a new run): a new term, above every earlier one.
            b.kill()
            b2 = await start_member(nursery, network, metaservers, B, Copy(offset=10), incarnation="b2")
            assert b2.registration.role == "master" and b2.registration.epoch > second
            # The old master's restart (same folder) joins as a slave of that term.
            a2 = await start_member(nursery, network, metaservers, A, Copy(offset=10), incarnation="a2")
            assert (a2.registration.role, a2.registration.epoch) == ("slave", b2.registration.epoch)


async def test_registration_member_and_replica_reach_the_metaserver(
    autojump_clock: trio.testing.MockClock, metaservers: Any
) -> None:
    async with metaservers.on_network() as (meta, network, nursery):
        copy = Copy(offset=42, in_sync=(B,))
        master = await start_member(nursery, network, metaservers, A, copy)
        await start_member(nursery, network, metaservers, B, Copy(offset=40))
        await recorded(master.registration, B)
        row = (await status_rows(network))[A]
        assert (row["member"], row["offset"], row["in_sync"]) == (f"folder-{A}", 42, False)
        assert (await status_rows(network))[B]["in_sync"] is True
        copy.offset = 99  # replica() is read for each heartbeat
        before = master.registration.statistics().heartbeats
        master.registration.heartbeat_now()
        await trio.testing.wait_all_tasks_blocked()  # sent and answered at once, not an interval later
        assert master.registration.statistics().heartbeats == before + 1
        assert (await status_rows(network))[A]["offset"] == 99
