"""NACK with ``release``: a consumer gives back what it never handed to its application.

The group gets it at once with ``attempts`` unchanged; without ``end`` the release runs
to the end of the consumer's pull log and ends its waiting pulls. It is durable before it
is answered (a restart, and a failover under sync replication, keep it). Driven by the trio
clock (autojump) over in-memory connections.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import decode_batch

from ..support.polling import wait_until
from .test_realtime_replication import CONSUMER, A, B, C, open_cluster

ACK_TIMEOUT_MS = 60_000


async def test_a_release_gives_back_at_once_with_attempts_unchanged(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(ack_timeout_ms=ACK_TIMEOUT_MS) as server:
        async with rt.memory_client(server, consumer="a") as a, rt.memory_client(server, consumer="b") as b:
            await a.send(rt.messages(5))
            taken = await a.pull(5, **{"from": "earliest"})
            await a.ack(taken.start, taken.start + 2)
            released_at = trio.current_time()
            assert await a.nack(taken.start + 2, taken.end, release=True) == taken.end
            again = await b.pull(10, timeout_ms=1_000, **{"from": "earliest"})
            assert trio.current_time() - released_at < 1  # not the 60 s ack timeout
            assert again.ids == taken.ids[2:]
            assert [m.attempts for m in again.messages] == [0, 0, 0]
            # A repeat, or an ack of what went back, is harmless; nothing comes back to a.
            assert await a.nack(taken.start + 2, taken.end, release=True) == taken.end
            assert await a.ack(taken.start, taken.end) == taken.end
            stats = server.statistics()
            assert (stats.redeliveries, stats.nacks, stats.messages_delivered) == (0, 2, 8)
            # b does not ack: after the ack timeout they come back, now one attempt higher.
            later = await b.pull(10, timeout_ms=ACK_TIMEOUT_MS + 10_000)
            assert later.ids == taken.ids[2:] and [m.attempts for m in later.messages] == [1, 1, 1]


async def test_a_release_without_end_takes_back_unread_hand_outs_and_ends_waiting_pulls(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(ack_timeout_ms=ACK_TIMEOUT_MS) as server:
        async with rt.memory_client(server, consumer="a") as a, rt.memory_client(server, consumer="b") as b:
            await a.send(rt.messages(5))
            read = await a.pull(2, **{"from": "earliest"})  # a read these two
            unread = await a.pull(3)  # as if this answer never reached a
            await a.ack(read.start, read.end)
            waiting: list[int] = []

            async def long_poll() -> None:
                waiting.append((await a.pull(10, timeout_ms=30_000)).count)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_poll)
                await rt.wait_until(lambda: server.statistics().pulls_waiting == 1)
                started = trio.current_time()
                # From the end of what a read: everything past it, and its waiting pull ends empty.
                assert await a.nack(read.end, None, release=True) == unread.end  # all settled
            assert trio.current_time() - started < 1 and waiting == [0]
            again = await b.pull(10, **{"from": "earliest"})
            assert again.ids == unread.ids and [m.attempts for m in again.messages] == [0, 0, 0]
            # What comes next goes to the group, not to the pull that ended.
            await a.send(rt.messages(1, prefix="n"))
            assert (await b.pull(10, timeout_ms=1_000)).ids == ["n00000"]
            # Past the end it releases nothing, and is no error.
            assert await a.nack(unread.end + 100, None, release=True) == unread.end
            assert server.statistics().redeliveries == 0


async def test_a_pull_sent_before_the_release_to_the_end_and_arriving_after_it_hands_out_nothing(
    rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """A closing consumer's releases go over connections of their own: its last PULL, sent
    before it stopped, may reach the server after them. Served, it would take what they
    gave back and hold it, for nobody, until the ack timeout."""
    async with local.server(ack_timeout_ms=ACK_TIMEOUT_MS) as server:
        async with (
            rt.memory_client(server, consumer="a") as a,
            rt.memory_client(server, consumer="a") as closing,
            rt.memory_client(server, consumer="b") as b,
        ):
            await a.send(rt.messages(5))
            read = await a.pull(5, **{"from": "earliest"})
            await closing.ack(read.start, read.start + 1)
            assert await closing.nack(read.end, None, release=True) == read.start + 1  # a read all there is
            assert await closing.nack(read.start + 1, read.end, release=True) == read.end
            started = trio.current_time()
            late = await a.pull(10, timeout_ms=30_000)  # on the connection a pulled on, sent before
            assert late.count == 0 and trio.current_time() - started < 1
            again = await b.pull(10, timeout_ms=1_000, **{"from": "earliest"})
            assert again.ids == read.ids[1:] and [m.attempts for m in again.messages] == [0] * 4
            await b.ack(again.start, again.end)
            # A new run under the same consumer id, on a connection of its own, is served as ever.
            async with rt.memory_client(server, consumer="a") as rerun:
                await rerun.send(rt.messages(1, prefix="n"))
                assert (await rerun.pull(10, timeout_ms=1_000)).ids == ["n00000"]
            stats = server.statistics()
            assert (stats.messages_delivered, stats.redeliveries, stats.released) == (5 + 4 + 1, 0, 4)


@pytest.mark.parametrize(
    ("extra", "end", "code", "field"),
    [
        ({"release": True, "delay_ms": 1_000}, 1, "bad_value", "release"),
        ({"release": True, "dead": True}, 1, "bad_value", "release"),
        ({"release": 1}, 1, "bad_value", "release"),
        ({}, None, "bad_request", "end"),  # only a release may leave out its end
        ({"release": True}, 2, "unknown_pull", "end"),  # an explicit end is checked as ever
    ],
)
async def test_bad_releases_are_refused_naming_the_field(
    rt: SimpleNamespace,
    local: Any,
    autojump_clock: trio.testing.MockClock,
    extra: dict[str, Any],
    end: int | None,
    code: str,
    field: str,
) -> None:
    async with local.server() as server, rt.memory_client(server) as client:
        await client.send(rt.messages(1))
        await client.pull(1, **{"from": "earliest"})
        with pytest.raises(PeerError) as refused:
            await client.nack(0, end, **extra)
        assert (refused.value.code, refused.value.field) == (code, field)
        assert server.statistics().redeliveries == 0


async def test_an_ack_takes_no_release(rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with local.server() as server, rt.memory_client(server) as client:
        await client.send(rt.messages(1))
        await client.pull(1, **{"from": "earliest"})
        with pytest.raises(PeerError) as refused:
            await client.ack(0, 1, release=True)
        assert (refused.value.code, refused.value.field) == ("bad_request", "release")


async def test_a_release_answered_before_a_crash_stays_given_back(
    tmp_path: Path, rt: SimpleNamespace, local: Any, autojump_clock: trio.testing.MockClock
) -> None:
    options = {"ack_timeout_ms": 5_000, "checkpoint_interval_ms": 600_000}
    async with local.server(**options) as server:
        async with rt.memory_client(server, consumer="a") as a:
            await a.send(rt.messages(4))
            taken = await a.pull(4, **{"from": "earliest"})
            await a.nack(taken.start + 1, taken.end, release=True)  # answered once committed
            server.crash()
            await trio.sleep_forever()  # cancelled by the crash
    async with local.server(**options) as server:
        async with rt.memory_client(server, consumer="b") as b:
            again = await b.pull(10, **{"from": "earliest"})
            # At once and as they were; m0, still a's, only after the ack timeout.
            assert again.ids == taken.ids[1:] and [m.attempts for m in again.messages] == [0, 0, 0]
            await b.ack(again.start, again.end)
            late = await b.pull(10, timeout_ms=20_000)
            assert late.ids == taken.ids[:1] and late.messages[0].attempts == 1
            await b.ack(late.start, late.end)
            assert (await b.pull(10, timeout_ms=20_000)).count == 0  # nothing twice


async def test_a_slave_promoted_after_a_release_has_the_messages_back_in_the_group(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        master, slave = await cluster.pair(min_insync=1, ack_timeout_ms=10_000)
        third = await cluster.start(C, min_insync=1, ack_timeout_ms=10_000)  # a slave for the next master
        await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
        names = [f"m{i}" for i in range(10)]
        assert await cluster.send(A, names) == ["stored"] * 10
        start, got = await cluster.pull(A, 10)
        await cluster.ack(A, start, start + 2)  # m0, m1 acked; m2, m3 kept; m4..m9 released
        await cluster.net.call(A, Command.NACK, {**CONSUMER, "start": start + 4, "end": start + 10, "release": True})
        cluster.kill(A)
        await wait_until(lambda: slave.role == "master")
        await wait_until(lambda: slave.replica_info().get("in_sync") == [C])
        promoted = cluster.clock.monotonic_ms()
        other = {**CONSUMER, "consumer": "c2"}
        frame = await cluster.net.call(B, Command.PULL, {**other, "max": 100, "timeout_ms": 1_000, "from": "earliest"})
        first = [(m.id, m.attempts) for m in decode_batch(frame.body)]
        # Released: in the group at once, as they were; not held by c1 any more.
        assert first == [(name, 0) for name in names[4:]]
        assert cluster.clock.monotonic_ms() - promoted < 10_000
        await cluster.net.call(B, Command.ACK, {**other, "start": frame.metadata["pull_start"], "end": len(first)})
        # Only c1's two kept hand-outs come back after the ack timeout, marked; nothing else, ever.
        seen: list[tuple[str, int]] = []
        for _ in range(3):
            frame = await cluster.net.call(B, Command.PULL, {**other, "max": 100, "timeout_ms": 15_000})
            batch = decode_batch(frame.body)
            seen += [(m.id, m.attempts) for m in batch]
            if batch:
                pulled = frame.metadata["pull_start"]
                await cluster.net.call(B, Command.ACK, {**other, "start": pulled, "end": pulled + len(batch)})
        assert seen == [("m2", 1), ("m3", 1)]
