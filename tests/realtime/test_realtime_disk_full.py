"""A full disk at each step of a SEND: refused as ``unavailable`` or stored and delivered, never stuck.

``FullDisk`` makes writes under chosen paths fail with ENOSPC, as a full file
system does (a filling disk first takes part of a write), and lmdb commits there
fail as lmdb does on a full disk; ``free`` gives the space back. The server runs
in this process on the trio clock (autojump), so a minute of full disk costs
nothing. A real full tmpfs is in tests/faults/test_faults_disk_full.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message
from delaymq.realtime import RealtimeServer
from delaymq.realtime.consumelog import subject_stem
from delaymq.storage.testing import FullDisk


@dataclass
class Outage:
    """In-process servers (``local``) whose data folder is on a disk that fills (``disk``), and what they logged."""

    local: Any  # LocalServers, tests/realtime/conftest.py
    disk: FullDisk
    caplog: pytest.LogCaptureFixture

    @property
    def data(self) -> Path:
        return self.local.data

    def server(self) -> AbstractAsyncContextManager[RealtimeServer]:
        """The server on ``data`` (opened again, it reads what the outage left)."""
        return self.local.server()

    @asynccontextmanager
    async def joined(self, rt: SimpleNamespace) -> AsyncIterator[tuple[RealtimeServer, Any]]:
        """The server, and a client of it that joined its group (so its pull log exists)."""
        async with self.server() as server, rt.memory_client(server) as client:
            await client.pull(timeout_ms=0)
            yield server, client

    def complaints(self) -> list[logging.LogRecord]:
        """What the servers logged at WARNING or above."""
        return [r for r in self.caplog.records if r.levelno >= logging.WARNING and r.name.startswith("delaymq")]

    def tracebacks(self) -> list[logging.LogRecord]:
        return [r for r in self.caplog.records if r.exc_info and r.name.startswith("delaymq")]


@pytest.fixture
async def outage(local: Any, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Outage]:
    with FullDisk() as disk:
        yield Outage(local, disk, caplog)


async def receive(client: Any, count: int, *, seconds: float = 30) -> list[Message]:
    """Pull and ack until ``count`` messages came (long polls; fails after ``seconds`` of trio time)."""
    got: list[Message] = []
    with trio.fail_after(seconds):
        while len(got) < count:
            pulled = await client.pull(100, timeout_ms=1000)
            got.extend(pulled.messages)
            if pulled.count:
                await client.ack(pulled.start, pulled.end)
    return got


async def everything(server: Any, rt: SimpleNamespace, subject: str = "orders") -> list[str]:
    """Every id in ``subject``'s consume log, read by a new group from the start."""
    async with rt.memory_client(server, group=f"audit-{subject}", subject=subject) as reader:
        ids: list[str] = []
        while True:
            pulled = await reader.pull(100, **{"from": "earliest"})
            if not pulled.count:
                return ids
            ids.extend(pulled.ids)


async def test_a_full_message_log_refuses_the_send_as_unavailable_and_its_retry_is_stored(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    first, refused = rt.messages(5, prefix="a"), rt.messages(5, prefix="b")
    async with outage.joined(rt) as (server, client):
        assert await client.send(first) == ["stored"] * 5
        end = server.statistics().message_log_end
        # The disk fills during the write: half the batch reaches the segment.
        outage.disk.fill(outage.data / "messages", partial=True)
        for _ in range(3):  # the producer retries while it stays full for a minute
            with pytest.raises(PeerError) as error:
                await client.send(refused)
            assert error.value.code == "unavailable"
            assert "disk is full" in str(error.value)
            await trio.sleep(20)
        assert server.statistics().message_log_end == end  # no torn half-record left in the log
        outage.disk.free()
        assert await client.send(refused) == ["stored"] * 5  # stored now, not a false "duplicate"
        got = await receive(client, 10)
        assert [m.id for m in got] == [m.id for m in first + refused]
        assert server.statistics().duplicates == 0
    assert len(outage.complaints()) == 1, outage.complaints()  # one line for the outage
    assert not outage.tracebacks()
    async with outage.server() as server:
        # The log reopens whole: every record once, the later ones right after the earlier.
        assert await everything(server, rt) == [m.id for m in first + refused]


async def test_a_send_of_an_id_being_appended_waits_for_it_and_is_no_false_duplicate(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    batch = rt.messages(3)
    async with outage.server() as server:
        async with rt.memory_client(server) as first, rt.memory_client(server) as second:
            outage.disk.fill(outage.data / "messages")
            answers: list[str] = []

            async def send(client: Any) -> None:
                try:
                    answers.extend(await client.send(batch))
                except PeerError as error:
                    answers.append(error.code)

            async with trio.open_nursery() as nursery:  # the second arrives while the first is appended
                nursery.start_soon(send, first)
                nursery.start_soon(send, second)
            assert answers == ["unavailable", "unavailable"]  # neither is told "duplicate"
            outage.disk.free()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send, first)
                nursery.start_soon(send, second)
            assert sorted(answers[2:]) == ["duplicate"] * 3 + ["stored"] * 3  # "duplicate" once it is stored
            assert (await everything(server, rt)) == [m.id for m in batch]


async def test_a_failed_consume_log_write_is_retried_and_nothing_waits_behind_it(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    outage.caplog.set_level(logging.INFO)
    mixed = [Message("o1", "orders"), Message("p1", "payments"), Message("o2", "orders")]
    later = rt.messages(20, prefix="late")
    async with outage.server() as server:
        async with rt.memory_client(server) as orders, rt.memory_client(server, subject="payments") as payments:
            await orders.pull(timeout_ms=0)
            await payments.pull(timeout_ms=0)
            # Only the payments consume log is full: the orders entries of the same batch
            # are written, then the payments one fails.
            outage.disk.fill(outage.data / "consume" / f"{subject_stem('payments')}.log")
            assert await orders.send(mixed) == ["stored"] * 3  # in the message log: it will be delivered
            for i in range(0, 20, 5):
                assert await orders.send(later[i : i + 5]) == ["stored"] * 5
            # Held back while the index step fails (checkpoints run meanwhile) ...
            assert (await orders.pull(100, timeout_ms=60_000)).count == 0
            stats = server.statistics()
            assert stats.indexed_offset < stats.message_log_end and stats.checkpoints > 0
            # ... and delivered, in order, once space comes back: no restart.
            outage.disk.free()
            got = await receive(orders, 22)
            assert [m.id for m in got] == ["o1", "o2"] + [m.id for m in later]
            assert [m.id for m in await receive(payments, 1)] == ["p1"]
            assert await orders.send(mixed) == ["duplicate"] * 3  # truly stored: the retry is one
            stats = server.statistics()
            assert stats.indexed_offset == stats.message_log_end
    index_lines = [r for r in outage.caplog.records if r.name == "delaymq.realtime.index"]
    assert [r.levelno for r in index_lines] == [logging.WARNING, logging.INFO], index_lines
    assert "disk is full" in index_lines[0].getMessage()
    assert len(outage.complaints()) == 1 and not outage.tracebacks()
    async with outage.server() as server:
        # What the checkpoints committed during the outage is consistent: each entry once.
        assert await everything(server, rt) == ["o1", "o2"] + [m.id for m in later]
        assert await everything(server, rt, "payments") == ["p1"]


async def test_a_full_state_store_delays_checkpoints_only(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    first, second = rt.messages(3, prefix="a"), rt.messages(3, prefix="b")
    async with outage.joined(rt) as (server, client):
        assert await client.send(first) == ["stored"] * 3
        assert [m.id for m in await receive(client, 3)] == [m.id for m in first]
        outage.disk.fill(outage.data / "state")
        assert await client.send(second) == ["stored"] * 3  # SEND writes no lmdb
        pulled = await client.pull(10, timeout_ms=1000)
        assert pulled.ids == [m.id for m in second]
        with pytest.raises(PeerError) as error:  # an ACK waits for a checkpoint
            await client.ack(pulled.start, pulled.end)
        assert error.value.code == "unavailable"
        await trio.sleep(60)  # a minute of failing checkpoints
        failures = server.statistics().checkpoint_failures
        assert failures >= 2
        outage.disk.free()
        assert await client.ack(pulled.start, pulled.end) == pulled.end
    assert len(outage.complaints()) == 1, outage.complaints()
    assert not outage.tracebacks()
    async with outage.server() as server:
        async with rt.memory_client(server) as client:
            # The dedup ids and the acks of the outage were committed after it.
            assert await client.send(second) == ["duplicate"] * 3
            assert (await client.pull(10, timeout_ms=0)).count == 0


async def test_a_minute_of_full_disk_then_every_acknowledged_message_is_delivered(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    """Producers keep sending through a minute of full disk; nothing stuck after it."""
    acknowledged: list[str] = []
    refusals = 0
    async with outage.server() as server:
        async with rt.memory_client(server) as consumer:
            await consumer.pull(timeout_ms=0)

            async def produce(number: int) -> None:
                nonlocal refusals
                async with rt.memory_client(server) as producer:
                    for batch in range(30):
                        messages = rt.messages(10, prefix=f"p{number}b{batch}-")
                        while True:
                            try:
                                results = await producer.send(messages)
                            except PeerError as error:
                                assert error.code == "unavailable", error
                                refusals += 1
                                await trio.sleep(1)
                                continue
                            assert results == ["stored"] * 10
                            acknowledged.extend(m.id for m in messages)
                            break
                        await trio.sleep(0.5)

            async def a_minute_full() -> None:
                await trio.sleep(3)
                outage.disk.fill(outage.data, partial=True)
                await trio.sleep(60)
                outage.disk.free()

            async with trio.open_nursery() as nursery:
                for number in range(3):
                    nursery.start_soon(produce, number)
                nursery.start_soon(a_minute_full)
            got = await receive(consumer, len(acknowledged))
            assert sorted(m.id for m in got) == sorted(acknowledged)  # every one, once
            assert refusals > 0
    assert not outage.tracebacks()
    assert len(outage.complaints()) <= 2, outage.complaints()  # the message log, the index step


async def test_a_pull_whose_pull_log_cannot_be_written_is_refused_and_hands_out_nothing(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    batch = rt.messages(4)
    async with outage.joined(rt) as (server, client):
        assert await client.send(batch) == ["stored"] * 4
        outage.disk.fill(outage.data / "pull")
        with pytest.raises(PeerError) as error:
            await client.pull(10)
        assert error.value.code == "unavailable" and "disk is full" in str(error.value)
        outage.disk.free()
        got = await client.pull(10)
        # The same messages, in order, as first deliveries: the refused pull handed out nothing.
        assert got.ids == [m.id for m in batch] and [m.attempts for m in got.messages] == [0] * 4
        await client.ack(got.start, got.end)
    assert not outage.tracebacks()
    async with outage.server() as server:  # and it reopens cleanly
        async with rt.memory_client(server) as client:
            assert (await client.pull(10, timeout_ms=0)).count == 0


async def test_a_pull_log_write_cut_short_leaves_no_hand_out_for_a_restart_to_find(
    rt: SimpleNamespace, outage: Outage, autojump_clock: trio.testing.MockClock
) -> None:
    batch = rt.messages(5)
    async with outage.joined(rt) as (server, client):
        assert await client.send(batch) == ["stored"] * 5
        outage.disk.fill(outage.data / "pull", partial=True)  # half the entries reach the file
        with pytest.raises(PeerError) as error:
            await client.pull(10)
        assert error.value.code == "unavailable"
    outage.disk.free()
    async with outage.server() as server, rt.memory_client(server, consumer="other") as other:
        # Nobody was handed anything: another consumer of the group gets all five at once, as first deliveries.
        got = await other.pull(10, timeout_ms=0)
        assert got.ids == [m.id for m in batch] and [m.attempts for m in got.messages] == [0] * 5
