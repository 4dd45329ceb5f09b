"""The registration agent of a replicated group's server: its role, epoch and handover target.

Against a scripted metaserver (an ``AsyncCaller`` whose answers the test sets),
under ``autojump_clock``, so what the agent sends and when is exactly visible.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.client.membership import MembershipView
from delaymq.client.registration import Registration, run_registration, start_registration
from delaymq.clock import TrioClock
from delaymq.protocol.commands import Command
from delaymq.protocol.frames import Frame, FrameKind
from delaymq.protocol.routes import ServerKind

T0 = 1_767_225_600_000
META = "meta:20880"
ME, OTHER = "10.0.0.2:1", "10.0.0.1:1"
INTERVAL_MS = 1_000


class ScriptedMetaserver:
    """Answers every REGISTER and HEARTBEAT with ``answer``; records what was sent, and when."""

    def __init__(self, **answer: Any) -> None:
        self.answer: dict[str, Any] = {
            "state": "RW",
            "master": OTHER,
            "route_version": 1,
            "heartbeat_interval_ms": INTERVAL_MS,
            **answer,
        }
        self.requests: list[tuple[float, int, dict[str, Any]]] = []

    async def call(self, address: str, command: int, metadata: dict[str, Any], *_: Any, **__: Any) -> Frame:
        self.requests.append((trio.current_time(), command, dict(metadata)))
        return Frame(FrameKind.RESPONSE, command, 1, dict(self.answer), b"")


class Copy:
    """The replica state a server reports: read anew for each request."""

    def __init__(self) -> None:
        self.offset = 0
        self.reads = 0

    def report(self) -> dict[str, Any]:
        self.reads += 1
        return {"offset": self.offset, "epoch": 0}


async def start(nursery: trio.Nursery, meta: ScriptedMetaserver, copy: Copy, **info: Any) -> Registration:
    fields = {"group": "sched1", "kind": "scheduler", "role": "master", "address": ME, "version": "1", **info}
    registration: Registration = await nursery.start(
        partial(run_registration, meta, meta_address=META, info=fields, clock=TrioClock(T0), replica=copy.report)
    )
    return registration


async def test_a_promotion_wakes_wait_view_change_at_the_next_heartbeat(autojump_clock: trio.testing.MockClock) -> None:
    meta = ScriptedMetaserver(role="slave", epoch=5)
    async with trio.open_nursery() as nursery:
        registration = await start(nursery, meta, Copy())
        slave = registration.view()
        assert slave == MembershipView("slave", 5, OTHER, None)
        assert not registration.is_master
        assert await registration.wait_view_change(MembershipView(None, 0, None, None)) == slave  # differs already
        promoted_at = trio.current_time() + 0.3
        nursery.start_soon(promote_at, meta, promoted_at)
        with trio.fail_after(10):
            view = await registration.wait_view_change(slave)
        assert view == MembershipView("master", 6, ME, None)
        assert registration.is_master and registration.epoch == 6
        assert trio.current_time() == pytest.approx(promoted_at + 0.7)  # the heartbeat at +1 s brought it
        assert registration.statistics().role == "master" and registration.statistics().epoch == 6
        nursery.cancel_scope.cancel()


async def promote_at(meta: ScriptedMetaserver, moment: float) -> None:
    await trio.sleep_until(moment)
    meta.answer.update(role="master", epoch=6, master=ME)


async def test_heartbeat_now_sends_at_once_with_the_replica_state_of_that_moment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meta = ScriptedMetaserver(role="master", epoch=3, master=ME)
    copy = Copy()
    async with trio.open_nursery() as nursery:
        registration = await start(nursery, meta, copy, member="folder-2")
        started = trio.current_time()
        ((_, command, first),) = meta.requests
        assert command == Command.REGISTER and first["member"] == "folder-2"
        assert first["replica"] == {"offset": 0, "epoch": 0}
        await trio.sleep(0.25)
        copy.offset = 4096
        registration.heartbeat_now()
        registration.heartbeat_now()  # two asks before it goes out: one heartbeat
        await trio.testing.wait_all_tasks_blocked()
        at, command, sent = meta.requests[-1]
        assert (len(meta.requests), command, at) == (2, Command.HEARTBEAT, started + 0.25)
        assert sent == {"group": "sched1", "address": ME, "replica": {"offset": 4096, "epoch": 0}}
        await trio.sleep(1.1)  # and the schedule goes on from there
        assert [round(t - started, 3) for t, _, _ in meta.requests] == [0.0, 0.25, 1.25]
        assert copy.reads == 3
        nursery.cancel_scope.cancel()


async def test_the_first_heartbeat_comes_at_the_interval_the_answer_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Not at the 5 s default: that is a replicated group's whole failover time."""
    meta = ScriptedMetaserver(role="slave", epoch=1)
    async with trio.open_nursery() as nursery:
        await start(nursery, meta, Copy())
        started = meta.requests[0][0]
        await trio.sleep(2.5)
        assert [round(t - started, 3) for t, _, _ in meta.requests] == [0.0, 1.0, 2.0]
        nursery.cancel_scope.cancel()


async def test_a_handover_request_reaches_the_master_through_its_view(autojump_clock: trio.testing.MockClock) -> None:
    meta = ScriptedMetaserver(role="master", epoch=7, master=ME)
    async with trio.open_nursery() as nursery:
        registration = await start(nursery, meta, Copy())
        meta.answer["handover_to"] = OTHER
        registration.heartbeat_now()
        with trio.fail_after(1):
            view = await registration.wait_view_change(registration.view())
        assert view == MembershipView("master", 7, ME, OTHER)
        nursery.cancel_scope.cancel()


async def test_an_answer_with_a_bad_role_is_a_failed_attempt(autojump_clock: trio.testing.MockClock) -> None:
    meta = ScriptedMetaserver(role="leader", epoch=1)
    async with trio.open_nursery() as nursery:
        registration = await start(nursery, meta, Copy())
        assert registration.role is None and registration.statistics().failures == 1
        nursery.cancel_scope.cancel()


async def test_groups_without_roles_keep_is_master_from_the_master_address(
    autojump_clock: trio.testing.MockClock,
) -> None:
    meta = ScriptedMetaserver(master=ME)
    async with trio.open_nursery() as nursery:
        registration: Registration = await start_registration(
            nursery, meta, group="rt1", kind=ServerKind.REALTIME, address=ME, meta_address=META, clock=TrioClock(T0)
        )
        assert registration.view() == MembershipView(None, 0, ME, None)
        assert registration.is_master
        ((_, _, sent),) = meta.requests
        assert "replica" not in sent and "member" not in sent
        nursery.cancel_scope.cancel()
