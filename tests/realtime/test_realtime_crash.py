"""A realtime server killed (SIGKILL, or ``crash()``: nothing more written) keeps every
acknowledged send and ack, and marks what it hands out again (``attempts`` raised)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from delaymq.clock import TrioClock
from delaymq.net.peers import open_peers
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message, tags_mask
from delaymq.realtime import open_realtime_server
from delaymq.realtime.checkpoint import decode_share, encode_share
from delaymq.realtime.consumelog import ENTRY_SIZE, subject_stem
from delaymq.realtime.groups import ConsumerState, Share
from delaymq.realtime.handouts import Member, reconcile
from delaymq.storage.threads import run_inline

pytestmark = pytest.mark.slow

SERVER_OPTIONS = {"ack_timeout_ms": 1000, "checkpoint_interval_ms": 600_000}


async def test_sigkill_and_restart_lose_no_acknowledged_send_or_ack(
    tmp_path: Path, rt: SimpleNamespace, server_processes: SimpleNamespace
) -> None:
    data = tmp_path / "realtime"
    first = rt.messages(20, prefix="a")
    second = rt.messages(20, prefix="b")
    with trio.fail_after(60):
        async with open_peers() as peers:
            async with server_processes.realtime(data, **SERVER_OPTIONS) as (address, _):
                producer = rt.peers_client(peers, address)
                c1 = rt.peers_client(peers, address, consumer="c1")
                assert await producer.send(first) == ["stored"] * 20
                taken = await c1.pull(10, **{"from": "earliest"})
                assert taken.ids == [m.id for m in first[:10]]
                assert await c1.ack(0, 5) == 5  # committed: positions, acks, index so far
                assert await producer.send(second) == ["stored"] * 20  # indexed, not checkpointed
            # SIGKILLed. The consume-log entries past the checkpoint may be torn or lost:
            # lose the last one and a half, and garble one before them.
            consume = data / "consume" / f"{subject_stem('orders')}.log"
            size = consume.stat().st_size
            assert size == 40 * ENTRY_SIZE
            os.truncate(consume, size - ENTRY_SIZE - ENTRY_SIZE // 2)
            with open(consume, "r+b") as file:
                file.seek(30 * ENTRY_SIZE + 3)
                file.write(b"\xff\xff")

            async with server_processes.realtime(data, **SERVER_OPTIONS) as (address, _):
                producer = rt.peers_client(peers, address)
                everything = await rt.peers_client(peers, address, group="g2").pull(100, **{"from": "earliest"})
                assert everything.ids == [m.id for m in first + second]
                assert [m.body for m in everything.messages] == [m.body for m in first + second]
                assert await producer.send([first[0], second[-1], Message("new", "orders")]) == [
                    "duplicate",
                    "duplicate",
                    "stored",
                ]
                # The group resumes where it was; c1's unacked five come back after the
                # ack timeout (with attempts 1), its acked five never do.
                c2 = rt.peers_client(peers, address, consumer="c2")
                got: dict[str, int] = {}
                while len(got) < 15 + 20 + 1:
                    pulled = await c2.pull(100, timeout_ms=5000)
                    for message in pulled.messages:
                        assert message.id not in got, f"{message.id} delivered twice"
                        got[message.id] = message.attempts
                    if pulled.count:
                        await c2.ack(pulled.start, pulled.end)
                assert set(got) == {m.id for m in first[5:] + second} | {"new"}
                assert {got[m.id] for m in first[5:10]} == {1}
                assert {got[m.id] for m in first[10:] + second} == {0}


EPOCH = 1_700_000_000_000


async def collect(client: Any, want: set[str], *, poll_ms: int = 60_000) -> dict[str, int]:
    """Pull and ack until every id of ``want`` came; returns each id's ``attempts``.

    Fails on an id delivered twice or one not wanted.
    """
    got: dict[str, int] = {}
    while not want <= got.keys():
        pulled = await client.pull(100, timeout_ms=poll_ms)
        for message in pulled.messages:
            assert message.id not in got, f"{message.id} delivered twice after the restart"
            assert message.id in want, f"{message.id} was not expected"
            got[message.id] = message.attempts
        if pulled.count:
            await client.ack(pulled.start, pulled.end)
    return got


async def test_after_a_crash_what_was_handed_out_comes_back_marked_and_late_acks_still_count(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    clock = TrioClock(EPOCH)
    options: dict[str, Any] = dict(
        data_dir=tmp_path, clock=clock, checkpoint_interval_ms=3_600_000, ack_timeout_ms=5_000, run_blocking=run_inline
    )
    sent = rt.messages(30)
    ids = [m.id for m in sent]
    async with open_realtime_server(**options) as server:
        async with (
            rt.memory_client(server, consumer="c1") as c1,
            rt.memory_client(server, consumer="c2") as c2,
            rt.memory_client(server, consumer="c3") as c3,
        ):
            assert await c1.send(sent) == ["stored"] * 30
            first = await c1.pull(10, **{"from": "earliest"})
            assert first.ids == ids[:10]
            await c1.ack(first.start + 1, first.end)  # answered after a checkpoint
            await c1.nack(first.start, first.start + 1)  # m0 back to the group, committed too
            # Handed out after the last checkpoint, known only to the pull logs:
            c2_got = await c2.pull(3)
            assert c2_got.ids == [ids[0], ids[10], ids[11]]
            assert [m.attempts for m in c2_got.messages] == [1, 0, 0]
            c1_got = await c1.pull(4)
            assert c1_got.ids == ids[12:16]
            c3_got = await c3.pull(2)
            assert c3_got.ids == ids[16:18]
            server.crash()
            await trio.sleep_forever()  # cancelled by the crash
    assert server.crashed

    async with open_realtime_server(**options) as server:
        async with rt.memory_client(server, consumer="c1") as c1, rt.memory_client(server, consumer="c4") as c4:
            # c1 acks what it was handed before the crash: it still counts.
            assert await c1.ack(c1_got.start, c1_got.end) == c1_got.end
            # c2 and c3 never come back: their hand-outs return after the ack
            # timeout, one attempt higher; the rest comes once, as new.
            got = await collect(c4, set(ids[18:]) | {ids[0], *ids[10:12], *ids[16:18]})
            assert got == {ids[0]: 2, ids[10]: 1, ids[11]: 1, ids[16]: 1, ids[17]: 1} | dict.fromkeys(ids[18:], 0)
            # Nothing else comes, however long it waits (m12..m15 were acked).
            assert (await c4.pull(100, timeout_ms=120_000)).count == 0
            with pytest.raises(PeerError) as error:
                await c1.ack(c1_got.end, c1_got.end + 1)
            assert error.value.code == "unknown_pull"


# ------------------------------------------------------------ reconcile, sans-IO


def handed(share: Share, name: str, committed: list[tuple[int, int]], tail: list[tuple[int, int]]) -> Member:
    """A consumer of ``share`` whose pull log holds ``committed`` (all unacked) then ``tail``
    ((consume-log sequence, redeliveries) each)."""
    consumer = ConsumerState(name.encode().ljust(16, b"-"), share.subject, share.group, name, share)
    for sequence, redeliveries in committed + tail:
        consumer.sequences.append(sequence)
        consumer.redeliveries.append(redeliveries)
    consumer.length = len(committed) + len(tail)
    return Member(consumer, len(committed))


def in_flight(member: Member) -> list[tuple[int, int]]:
    consumer = member.consumer
    return [
        (consumer.sequences[p], consumer.redeliveries[p])
        for start, end in consumer.progress.undone(consumer.acked, consumer.length)
        for p in range(start, end)
    ]


def test_reconcile_keeps_the_newest_hand_out_of_each_message() -> None:
    share = Share(b"s" * 16, "orders", "g", None, position=10)
    share.redeliver.extend([(2, 1), (3, 1)])  # given back before the checkpoint
    # a: held 5 and 6 at the checkpoint; after it took 2 from the queue and 10, 11 as new.
    a = handed(share, "a", committed=[(5, 0), (6, 0)], tail=[(2, 1), (10, 0), (11, 0)])
    # b: after the checkpoint a's 5 timed out and b took it (one more redelivery), then 13.
    b = handed(share, "b", committed=[], tail=[(5, 1), (13, 0)])
    result = reconcile([share], [a, b], lambda subject: 20, set())
    assert in_flight(a) == [(6, 0), (2, 1), (10, 0), (11, 0)]  # its 5 was handed to b since
    assert in_flight(b) == [(5, 1), (13, 0)]
    assert list(share.redeliver) == [(3, 1)]  # 2 was taken from the queue by a
    assert share.position == 12 and share.skip == {13}  # 12 was skipped (say by b's tag filter)
    assert (result.kept, result.superseded, result.dropped) == (5, 2, 0)
    assert result.consumers == {a.consumer, b.consumer} and result.shares == {share}
    # The skip set survives a checkpoint.
    assert decode_share(share.key, encode_share(share)).skip == {13}


def test_reconcile_drops_what_points_past_the_consume_log() -> None:
    share = Share(b"s" * 16, "orders", "g", None, position=30)
    share.redeliver.extend([(4, 1), (25, 2)])
    held = handed(share, "a", committed=[(3, 0), (24, 0)], tail=[(26, 0)])
    result = reconcile([share], [held], lambda subject: 20, set())  # entries 20.. are lost
    assert in_flight(held) == [(3, 0)]
    assert list(share.redeliver) == [(4, 1)]
    assert share.position == 20 and not share.skip
    assert (result.dropped, result.moved_back) == (3, 1)


def test_reconcile_starts_a_share_the_checkpoint_missed_at_its_first_hand_out() -> None:
    share = Share(b"n" * 16, "orders", "new-group", None, position=50)  # created at the count
    first = handed(share, "a", committed=[], tail=[(40, 0), (42, 0)])
    reconcile([], [first], lambda subject: 50, {share})
    assert share.position == 41 and share.skip == {42}


async def test_a_tag_filtered_group_after_a_crash_neither_repeats_nor_skips_its_messages(
    tmp_path: Path, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    assert tags_mask(["paid"]) != tags_mask(["free"])  # the server's filter tells them apart
    clock = TrioClock(EPOCH)
    options: dict[str, Any] = dict(
        data_dir=tmp_path, clock=clock, checkpoint_interval_ms=3_600_000, ack_timeout_ms=5_000, run_blocking=run_inline
    )
    sent = [Message(f"m{i:02d}", "orders", tags=("paid" if i % 2 == 0 else "free",)) for i in range(12)]
    paid = [m.id for m in sent if "paid" in m.tags]
    async with open_realtime_server(**options) as server:
        async with rt.memory_client(server, consumer="p") as client:
            assert await client.send(sent) == ["stored"] * 12  # a SEND commits nothing
            first = await client.pull(3, tags=["paid"], **{"from": "earliest"})
            assert first.ids == paid[:3]
            server.crash()
            await trio.sleep_forever()
    async with open_realtime_server(**options) as server:
        async with rt.memory_client(server, consumer="p2") as client:
            more = [Message(f"n{i}", "orders", tags=("paid",)) for i in range(2)]
            assert await client.send(more) == ["stored"] * 2
            got: dict[str, int] = {}
            want = set(paid) | {m.id for m in more}
            while not want <= got.keys():
                pulled = await client.pull(100, timeout_ms=60_000, tags=["paid"])
                for message in pulled.messages:
                    assert message.id not in got and message.id in want, message.id
                    got[message.id] = message.attempts
                if pulled.count:
                    await client.ack(pulled.start, pulled.end)
            assert got == dict.fromkeys(paid[:3], 1) | dict.fromkeys(paid[3:] + [m.id for m in more], 0)
