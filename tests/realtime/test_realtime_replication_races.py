"""Realtime replication at its edges, in-process under ``autojump_clock``: a deposed master's
unreplicated hand-outs, a progress record cut off by a cancel, an ACK or a NACK in flight
when the master session ends. Each reproduced a lost ack, a stuck index or a stuck request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from delaymq.net.connection import TransportError
from delaymq.protocol.commands import Command
from delaymq.protocol.fencing import Fence
from delaymq.protocol.records import decode_batch
from delaymq.realtime.server import RealtimeServer

from ..support.polling import wait_until
from .test_realtime_replication import CONSUMER, GROUP, META, A, B, C, Cluster, open_cluster

OPTIONS = {"min_insync": 1, "ack_timeout_ms": 10_000}


async def trio_of(cluster: Cluster) -> tuple[RealtimeServer, RealtimeServer, RealtimeServer]:
    """A master and two in-sync slaves (so a group that lost one member still takes writes)."""
    master, slave = await cluster.pair(**OPTIONS)
    third = await cluster.start(C, **OPTIONS)
    await wait_until(lambda: third.role == "slave" and master.replica_info().get("in_sync") == [B, C])
    return master, slave, third


async def pull(cluster: Cluster, address: str, consumer: str, count: int) -> tuple[int, list[tuple[str, int]]]:
    metadata = {**CONSUMER, "consumer": consumer, "max": count, "timeout_ms": 1_000, "from": "earliest"}
    frame = await cluster.net.call(address, Command.PULL, metadata)
    return frame.metadata["pull_start"], [(m.id, m.attempts) for m in decode_batch(frame.body)]


async def ack(cluster: Cluster, address: str, consumer: str, start: int, end: int) -> None:
    await cluster.net.call(address, Command.ACK, {**CONSUMER, "consumer": consumer, "start": start, "end": end})


def slow_disk(server: RealtimeServer) -> Callable[[], None]:
    """Make each append of the master's log take 50 ms; returns the undo."""
    writer = server.member.writer
    assert writer is not None
    inner = writer._run_blocking

    async def slow(work: Callable[[], Any]) -> Any:
        await trio.sleep(0.05)
        return await inner(work)

    writer._run_blocking = slow

    def undo() -> None:
        writer._run_blocking = inner

    return undo


async def test_hand_outs_a_deposed_master_never_replicated_do_not_come_back_after_they_were_acked(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        a, b, c = await trio_of(cluster)
        names = [f"m{i}" for i in range(40)]
        assert await cluster.send(A, names) == ["stored"] * 40
        start, _got = await pull(cluster, A, "c1", 10)
        await ack(cluster, A, "c1", start, start + 10)
        # Killed while a PULL's hand-outs wait to be replicated: only A's pull log has them.
        assert a.master is not None
        never: Callable[[], Awaitable[None]] = trio.sleep_forever
        a.master.pull_handler.handed_out = never

        async def unanswered_pull() -> None:
            with contextlib.suppress(TransportError):  # the master dies before it answers
                await pull(cluster, A, "c1", 10)

        cluster.nursery.start_soon(unanswered_pull)
        await wait_until(
            lambda: a.master is not None and any(x.length == 20 for x in a.master._groups.consumers.values())
        )
        cluster.kill(A)
        await wait_until(lambda: b.role == "master")
        back = await cluster.start(A, data_dir=tmp_path / A, **OPTIONS)
        await wait_until(lambda: back.role == "slave" and set(b.replica_info().get("in_sync", [])) == {A, C})
        for consumer in ("c1", "c2"):  # the new master hands m10.. to c1, m15.. to c2: all acked
            start, got = await pull(cluster, B, consumer, 5)
            await ack(cluster, B, consumer, start, start + len(got))
        end = b.member.storage.message_log.end_offset
        await wait_until(lambda: all(s.statistics().replication.get("applied_offset") == end for s in (back, c)))
        cluster.kill(B)
        await wait_until(lambda: back.role == "master" or c.role == "master")
        new = back if back.role == "master" else c
        await cluster.start(B, data_dir=tmp_path / B, **OPTIONS)
        await wait_until(lambda: len(new.replica_info().get("in_sync", [])) >= 1)
        await trio.sleep(15)  # past the ack timeout: what is still out comes back now
        seen: list[tuple[str, int]] = []
        while len(seen) < 20:
            start, got = await pull(cluster, new.address, "c2", 100)
            seen += got
            await ack(cluster, new.address, "c2", start, start + len(got))
        assert [name for name, _ in seen] == names[20:]  # m15..m19 were acked by c2: never again


async def test_a_progress_record_whose_request_was_cancelled_still_lets_the_index_go_on(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        a, _b = await cluster.pair(min_insync=1)
        assert a.master is not None
        fences = a.master.fences
        undo = slow_disk(a)
        async with trio.open_nursery() as nursery:

            async def admit(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await fences.admit(Fence("scheduler-1", 3))

            scope = await nursery.start(admit)
            await trio.sleep(0.01)  # the scheduler hangs up while the fence's record is appended
            scope.cancel()
        undo()
        assert await cluster.send(A, ["after"]) == ["stored"]
        _start, got = await cluster.pull(A, 10)
        assert [name for name, _ in got] == ["after"]


async def test_an_ack_whose_checkpoint_the_session_end_cut_off_is_not_answered_as_done(
    tmp_path: Path, autojump_clock: Any
) -> None:
    async with open_cluster(tmp_path) as cluster:
        a, b, _c = await trio_of(cluster)
        assert await cluster.send(A, [f"m{i}" for i in range(5)]) == ["stored"] * 5
        start, _got = await cluster.pull(A, 5)
        end = a.member.storage.message_log.end_offset
        await wait_until(lambda: all(r["acked"] >= end for r in a.statistics().replication["replicas"]))
        slow_disk(a)
        outcome: list[str] = []

        async def acking() -> None:
            try:
                await cluster.ack(A, start, start + 5)
                outcome.append("acked")
            except Exception as error:
                outcome.append(f"refused: {error}")

        cluster.nursery.start_soon(acking)
        await trio.sleep(0.01)
        a.roles.kick()  # the session ends (the metaserver's word changed) while the ACK's record is appended
        await wait_until(lambda: bool(outcome))
        cluster.kill(A)
        await wait_until(lambda: b.role == "master" and b.replica_info().get("in_sync") == [C])
        await trio.sleep(15)  # past the ack timeout
        _start, again = await cluster.pull(B, 100)
        assert outcome != ["acked"] or again == [], (outcome, again)  # answered acked: then never again


async def test_a_nack_in_flight_during_a_handover_is_answered(tmp_path: Path, autojump_clock: Any) -> None:
    async with open_cluster(tmp_path) as cluster:
        a, b, _c = await trio_of(cluster)
        assert await cluster.send(A, ["n1"]) == ["stored"]
        start, _got = await cluster.pull(A, 1)
        assert a.master is not None

        async def slow_scheduler(body: bytes, count: int, subject: str) -> bool:
            await trio.sleep(3)  # a scheduler that takes 3 s to take the retry
            return True

        a.master.retries._schedule = slow_scheduler  # type: ignore[method-assign]
        outcome: list[str] = []

        async def nack() -> None:
            metadata = {**CONSUMER, "start": start, "end": start + 1, "delay_ms": 5_000}
            try:
                await cluster.net.call(A, Command.NACK, metadata, timeout=600)
                outcome.append("answered")
            except Exception as error:
                outcome.append(f"refused: {error}")

        cluster.nursery.start_soon(nack)
        await trio.sleep(0.5)
        await cluster.net.call(META, Command.HANDOVER, {"group": GROUP, "to": B})
        await wait_until(lambda: b.role == "master" and a.role == "slave")
        await wait_until(lambda: bool(outcome), timeout=60)
        assert outcome == ["answered"]  # the handover waited for it; its retry is placed, not handed out again
        await trio.sleep(15)
        _start, again = await cluster.pull(B, 10)
        assert again == []
