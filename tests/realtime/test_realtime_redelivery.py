"""Redelivery and dedup driven by the trio clock (autojump) over in-memory connections."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message


async def test_a_consumer_that_died_has_its_messages_handed_to_another(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server() as server:
        async with (
            rt.memory_client(server, consumer="doomed") as doomed,
            rt.memory_client(server, consumer="survivor") as survivor,
        ):
            await doomed.pull(timeout_ms=0)
            await survivor.pull(timeout_ms=0)
            await doomed.send(rt.messages(5))
            taken = await doomed.pull(3)
            assert taken.ids == ["m00000", "m00001", "m00002"]
            assert {m.attempts for m in taken.messages} == {0}
            await doomed.ack(taken.start, taken.start + 1)  # it acks one, then dies
            died_at = trio.current_time()
            rest = await survivor.pull(10)
            assert rest.ids == ["m00003", "m00004"]
            await survivor.ack(rest.start, rest.end)
            # The survivor keeps long-polling (which keeps it alive); the dead one's
            # two unacked messages reach it once the 30 s consumer timeout passes.
            again = await survivor.pull(10, timeout_ms=25_000)
            while not again.count:
                again = await survivor.pull(10, timeout_ms=25_000)
            waited = trio.current_time() - died_at
            assert again.ids == ["m00001", "m00002"]
            assert [m.attempts for m in again.messages] == [1, 1]
            assert 30 <= waited < 60  # the consumer timeout, not the 60 s ack timeout
            await survivor.ack(again.start, again.end)
            stats = server.statistics()
            assert stats.redeliveries == 2 and stats.consumers == 1
            # The dead consumer's late ack of what was given back is harmless.
            assert await doomed.ack(taken.start, taken.end) == taken.end


async def test_unacked_messages_come_back_after_the_ack_timeout(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(ack_timeout_ms=5_000) as server:
        async with rt.memory_client(server) as client:
            await client.send(rt.messages(3))
            first = await client.pull(10, **{"from": "earliest"})
            await client.ack(first.start + 1, first.start + 2)  # acks the middle one only
            pulled_at = trio.current_time()
            assert (await client.pull(10)).count == 0  # nothing new; still alive
            await client.heartbeat()
            again = await client.pull(10, timeout_ms=20_000)
            assert 5 <= trio.current_time() - pulled_at < 10
            assert again.ids == ["m00000", "m00002"]
            assert [m.attempts for m in again.messages] == [1, 1]
            assert again.start == first.end  # appended to its own pull log
            # Not acked again: they come back once more, attempts 2.
            third = await client.pull(10, timeout_ms=20_000)
            assert third.ids == ["m00000", "m00002"] and [m.attempts for m in third.messages] == [2, 2]
            # Given back counts as done for the consumer: acking the rest completes its log.
            assert await client.ack(third.start, third.end) == third.end
            assert server.statistics().redeliveries == 4


async def test_nack_hands_the_message_back_at_once(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server() as server:
        async with rt.memory_client(server, consumer="a") as a, rt.memory_client(server, consumer="b") as b:
            await a.send(rt.messages(2))
            taken = await a.pull(10, **{"from": "earliest"})
            start = trio.current_time()
            assert await a.nack(taken.start, taken.start + 1) == 1
            again = await b.pull(10, timeout_ms=1000)
            assert trio.current_time() - start < 1
            assert again.ids == ["m00000"] and again.messages[0].attempts == 1
            assert server.statistics().nacks == 1


async def test_out_of_order_acks_merge_and_repeats_are_harmless(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server() as server:
        async with rt.memory_client(server) as client:
            await client.send(rt.messages(6))
            pulled = await client.pull(6, **{"from": "earliest"})
            assert await client.ack(4, 6) == 0
            assert await client.ack(1, 3) == 0
            assert await client.ack(1, 3) == 0
            assert await client.ack(0, 1) == 3
            assert await client.ack(3, 4) == 6
            assert await client.ack(0, 6) == 6
            with pytest.raises(PeerError) as error:
                await client.ack(5, 7)
            assert error.value.code == "unknown_pull" and error.value.limit == pulled.end
            # Nothing comes back: every message was acked before the ack timeout.
            assert (await client.pull(10, timeout_ms=120_000)).count == 0
            assert server.statistics().redeliveries == 0


async def test_dedup_window_survives_a_restart_and_then_expires(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    window = 60_000
    async with local.server(dedup_window_ms=window) as server:
        async with rt.memory_client(server) as client:
            assert await client.send([Message("once", "orders")]) == ["stored"]
    await trio.sleep(10)
    async with local.server(dedup_window_ms=window) as server:
        async with rt.memory_client(server) as client:
            assert await client.send([Message("once", "orders")]) == ["duplicate"]
            await trio.sleep(window / 1000)
            assert await client.send([Message("once", "orders")]) == ["stored"]
            pulled = await client.pull(10, **{"from": "earliest"})
            assert pulled.ids == ["once", "once"]


async def test_dedup_memory_cap_falls_back_to_lmdb(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(dedup_memory_ids=10, checkpoint_interval_ms=100) as server:
        async with rt.memory_client(server) as client:
            sent = rt.messages(50)
            await client.send(sent)
            await trio.sleep(1)  # a few checkpoints: ids move from pending to lmdb
            assert server.statistics().dedup_ids_in_memory <= 10
            assert await client.send(sent[:3]) == ["duplicate"] * 3
    # After a restart memory is loaded with the newest ids only; lmdb answers for the rest.
    async with local.server(dedup_memory_ids=10) as server:
        assert server.statistics().dedup_ids_in_memory <= 10
        async with rt.memory_client(server) as client:
            assert await client.send([sent[0], sent[49], Message("fresh", "orders")]) == [
                "duplicate",
                "duplicate",
                "stored",
            ]
            await trio.sleep(601)  # past the default 10-minute window
        async with rt.memory_client(server) as client:  # a new connection: the server closes idle ones after 5m
            assert await client.send(sent[:3]) == ["stored"] * 3


async def test_a_thousand_parked_pulls_wait_idle_and_one_message_goes_to_one(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server() as server:
        async with rt.memory_client(server) as client:
            got: list[tuple[str, list[str]]] = []

            async def wait(name: str) -> None:
                consumer = rt.Client(client._call, consumer=name)
                pulled = await consumer.pull(10, timeout_ms=20_000)
                got.append((name, pulled.ids))

            async with trio.open_nursery() as nursery:
                for number in range(1000):
                    nursery.start_soon(wait, f"c{number}")
                await rt.wait_until(lambda: server.statistics().pulls_waiting == 1000)
                started = trio.current_time()
                await client.send(rt.messages(1))
                await rt.wait_until(lambda: bool(got))
                assert trio.current_time() - started < 1
                assert server.statistics().pulls_waiting == 999  # the others parked again
            # The rest time out empty-handed at 20 s (before the unacked message
            # could come back to the group).
            assert [ids for _, ids in got if ids] == [["m00000"]]
            assert len(got) == 1000


@pytest.mark.parametrize("step_ms", [600_000, -600_000])
async def test_a_wall_clock_step_neither_fires_nor_postpones_the_ack_timeout(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock, step_ms: int
) -> None:
    async with local.server(ack_timeout_ms=5_000) as server:
        async with rt.memory_client(server) as client:
            await client.send(rt.messages(2))
            first = await client.pull(10, **{"from": "earliest"})
            pulled_at = trio.current_time()
            local.clock.step(step_ms)  # ten minutes forward, or back: the ack timeout is an interval
            assert (await client.pull(10, timeout_ms=1_000)).count == 0  # not given back at once
            again = await client.pull(10, timeout_ms=20_000)
            assert 5 <= trio.current_time() - pulled_at < 6  # five seconds after the hand-out, as set
            assert again.ids == first.ids and [m.attempts for m in again.messages] == [1, 1]


async def test_a_copy_sent_while_the_first_is_being_appended_waits_and_is_a_duplicate(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """A producer's retry that arrives while its first try is still being written is answered
    only once the first is stored, and then as a duplicate: stored once, never twice."""
    async with local.server() as server:
        writer = server.member.writer
        inner = writer._run_blocking

        async def slow(work: Any) -> Any:
            await trio.sleep(0.5)  # the first append is still on its way when the copy comes
            return await inner(work)

        writer._run_blocking = slow
        answers: dict[str, tuple[float, list[str]]] = {}
        sent = rt.messages(3)

        async def send(name: str, messages: list[Message], after: float) -> None:
            await trio.sleep(after)
            async with rt.memory_client(server) as client:
                results = await client.send(messages)
                answers[name] = (trio.current_time(), results)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "first", sent, 0)
            nursery.start_soon(send, "copy", [sent[1]], 0.1)
        assert answers["first"][1] == ["stored"] * 3
        assert answers["copy"][1] == ["duplicate"]
        assert answers["copy"][0] >= answers["first"][0]  # answered once the first was stored
        stats = server.statistics()
        assert (stats.messages_stored, stats.duplicates) == (3, 1)
