"""Records a scheduler sends ahead of their ``deliver_at`` (``--send-ahead``): stored at once,
handed out from the release tick of ``deliver_at`` on, never before it, after a restart too;
or up to ``ahead_ms`` before it to a PULL that asks (its consumer holds them until due)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from delaymq.protocol.errors import PeerError
from delaymq.protocol.limits import MAX_PULL_AHEAD_MS
from delaymq.protocol.records import Message
from delaymq.realtime.index import RELEASE_TICK_MS
from delaymq.realtime.send import MAX_AHEAD_MS

from .conftest import EPOCH


def ahead(name: str, at: int) -> Message:
    return Message(name, "orders", deliver_at=at, created_at=EPOCH, body=b"x")


async def test_a_record_sent_ahead_waits_for_its_tick_and_holds_the_subject_order_behind_it(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    due = EPOCH + 501  # released at the next tick: 504 with ticks of 4 ms
    tick = -(-due // RELEASE_TICK_MS) * RELEASE_TICK_MS
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        assert await client.send([ahead("later", due), Message("now", "orders", body=b"y")]) == ["stored"] * 2
        assert (await client.pull(10, **{"from": "earliest"})).count == 0  # stored, not due
        pulled = await client.pull(10, timeout_ms=5_000)  # parks until the tick, then both
        assert local.clock.now_ms() == tick
        assert pulled.ids == ["later", "now"]  # the subject's order: the immediate one waited behind
        handed = server.statistics().lateness_handed_out
        assert handed["early"] == 0 and handed["min"] >= 0


async def test_a_long_poll_is_not_answered_empty_by_a_record_not_due_yet(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        await client.send([ahead("late", EPOCH + 3_000)])
        started = trio.current_time()
        pulled = await client.pull(10, timeout_ms=1_000, **{"from": "earliest"})
        assert pulled.count == 0 and trio.current_time() - started == pytest.approx(1.0)  # its own timeout
        pulled = await client.pull(10, timeout_ms=10_000)
        assert pulled.ids == ["late"] and local.clock.now_ms() == EPOCH + 3_000


async def test_a_restart_keeps_holding_what_is_not_due(local: Any, rt: SimpleNamespace, autojump_clock: Any) -> None:
    due = EPOCH + 20_000
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        assert await client.send([ahead("held", due)]) == ["stored"]
    # Reopened (replay indexes the log again): still held until its moment.
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        assert (await client.pull(10, **{"from": "earliest"})).count == 0
        pulled = await client.pull(10, timeout_ms=60_000)
        assert pulled.ids == ["held"] and local.clock.now_ms() == due


async def test_immediate_messages_are_never_held_whatever_the_clocks_say(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    """A producer whose clock runs two minutes fast stamps an immediate message's
    ``deliver_at`` (= its ``created_at``) two minutes ahead: stored and handed out at once,
    nothing behind it waits. Nor does a step back of the realtime server's own wall clock
    hold what it indexed before the step; a message sent ahead still waits for the wall
    clock to read its moment (as the scheduler's wheel does)."""
    fast = EPOCH + 120_000
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        skewed = Message("skewed", "orders", deliver_at=fast, created_at=fast, body=b"s")
        assert await client.send([skewed, Message("plain", "orders", body=b"p")]) == ["stored"] * 2
        pulled = await client.pull(10, **{"from": "earliest"})
        assert pulled.ids == ["skewed", "plain"] and local.clock.now_ms() == EPOCH
        await client.ack(pulled.start, pulled.end)
        assert await client.send([Message("before-step", "orders", body=b"b")]) == ["stored"]
        assert await client.send([ahead("due-soon", EPOCH + 40)]) == ["stored"]
        local.clock.step(-600_000)  # ten minutes back: "before-step" now looks indexed in the future
        pulled = await client.pull(10, timeout_ms=1_000)
        assert pulled.ids == ["before-step"] and local.clock.now_ms() == EPOCH - 600_000
        await client.ack(pulled.start, pulled.end)
        pulled = await client.pull(10, timeout_ms=300_000)
        while not pulled.count:  # long polls of at most 5 minutes each
            pulled = await client.pull(10, timeout_ms=300_000)
        assert pulled.ids == ["due-soon"] and local.clock.now_ms() == EPOCH + 40  # by the wall clock


async def test_a_send_too_far_ahead_is_refused_naming_deliver_at_and_nothing_is_stored(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        assert await client.send([ahead("edge", EPOCH + MAX_AHEAD_MS)]) == ["stored"]
        end = server.statistics().message_log_end
        with pytest.raises(PeerError) as refused:
            await client.send([Message("fine", "orders"), ahead("far", EPOCH + MAX_AHEAD_MS + 1)])
        assert refused.value.code == "limit" and refused.value.field == "deliver_at"
        assert f"{MAX_AHEAD_MS} ms" in str(refused.value)
        assert server.statistics().message_log_end == end
        pulled = await client.pull(10, timeout_ms=MAX_AHEAD_MS + 1_000, **{"from": "earliest"})
        assert pulled.ids == ["edge"]


async def test_a_pull_asking_ahead_takes_what_falls_due_within_it_and_parks_for_the_rest(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    """``ahead_ms``: the consumer holds records until due, so a PULL takes them that long
    before; what is due later still waits (in order), and the answer comes when it may."""
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        sent = [ahead("soon", EPOCH + 150), Message("now", "orders", body=b"y"), ahead("later", EPOCH + 900)]
        assert await client.send(sent) == ["stored"] * 3
        pulled = await client.pull(10, ahead_ms=200, **{"from": "earliest"})
        assert pulled.ids == ["soon", "now"] and local.clock.now_ms() == EPOCH  # "later" holds the order
        pulled = await client.pull(10, ahead_ms=200, timeout_ms=5_000)  # parks until 900 - 200
        assert pulled.ids == ["later"]
        assert EPOCH + 700 <= local.clock.now_ms() < EPOCH + 700 + RELEASE_TICK_MS
        handed = server.statistics().lateness_handed_out
        assert handed["count"] == 3 and handed["early"] == 2  # the two scheduled ones, before their moment


@pytest.mark.parametrize("ahead_ms", [-1, MAX_PULL_AHEAD_MS + 1, "200", True])
async def test_a_pull_asking_too_far_ahead_is_refused_naming_ahead_ms(
    local: Any, rt: SimpleNamespace, autojump_clock: Any, ahead_ms: Any
) -> None:
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        assert await client.send([ahead("held", EPOCH + 100)]) == ["stored"]
        with pytest.raises(PeerError) as refused:
            await client.pull(10, ahead_ms=ahead_ms, **{"from": "earliest"})
        assert refused.value.field == "ahead_ms"
        pulled = await client.pull(10, ahead_ms=MAX_PULL_AHEAD_MS, **{"from": "earliest"})
        assert pulled.ids == ["held"]  # nothing handed out by the refused pull


async def test_a_record_fetched_ahead_and_given_back_is_not_handed_out_before_it_is_due(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    """Consumer "a" fetched it ahead, then gave it back (a nack, a close): another consumer
    of the group that does not fetch ahead gets it at its tick, not before; new entries pass."""
    due = EPOCH + 150
    tick = -(-due // RELEASE_TICK_MS) * RELEASE_TICK_MS
    async with local.server(listen=None) as server:
        async with rt.memory_client(server, consumer="a") as a, rt.memory_client(server, consumer="b") as b:
            assert await a.send([ahead("soon", due)]) == ["stored"]
            taken = await a.pull(10, ahead_ms=200, **{"from": "earliest"})
            assert taken.ids == ["soon"]
            await a.nack(taken.start, taken.end)  # given back at once
            assert await a.send([Message("now", "orders", body=b"y")]) == ["stored"]
            assert (await b.pull(10)).ids == ["now"]  # the new one goes; the given-back one waits
            assert local.clock.now_ms() == EPOCH
            again = await b.pull(10, timeout_ms=5_000)
            assert again.ids == ["soon"] and again.messages[0].attempts == 1
            assert local.clock.now_ms() == tick


async def test_a_pull_takes_at_most_half_the_ack_timeout_ahead(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    """Its ack timeout starts at the hand-out: one spent waiting for the moment would come back."""
    async with local.server(listen=None, ack_timeout_ms=300) as server, rt.memory_client(server) as client:
        assert await client.send([ahead("held", EPOCH + 400)]) == ["stored"]
        pulled = await client.pull(10, ahead_ms=MAX_PULL_AHEAD_MS, timeout_ms=5_000, **{"from": "earliest"})
        assert pulled.ids == ["held"] and local.clock.now_ms() == EPOCH + 400 - 150
