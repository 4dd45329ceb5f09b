"""End to end over loopback sockets: producers, groups, broadcast, tags, long polls, bad input."""

from __future__ import annotations

import struct
import zlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from delaymq.clock import SystemClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.peers import open_peers
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import Message, encode_message, tag_bit
from delaymq.realtime import open_realtime_server


async def test_one_group_many_producers_and_consumers_get_each_message_once(
    tmp_path: Path, rt: SimpleNamespace
) -> None:
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        consumers = [rt.peers_client(peers, server.address, consumer=f"c{i}") for i in range(3)]
        # Join the group before anything is sent (a new group starts at the latest entry).
        for consumer in consumers:
            assert (await consumer.pull(timeout_ms=0)).count == 0
        received: Counter[str] = Counter()
        total = 4 * 5 * 20

        async def produce(number: int) -> None:
            producer = rt.peers_client(peers, server.address)
            for batch in range(5):
                results = await producer.send(rt.messages(20, prefix=f"p{number}b{batch}-"))
                assert results == ["stored"] * 20

        async def consume(client: object) -> None:
            while sum(received.values()) < total:
                pulled = await client.pull(7, timeout_ms=200)  # type: ignore[attr-defined]
                received.update(pulled.ids)
                if pulled.count:
                    assert await client.ack(pulled.start, pulled.end) == pulled.end  # type: ignore[attr-defined]

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for number in range(4):
                    nursery.start_soon(produce, number)
                for consumer in consumers:
                    nursery.start_soon(consume, consumer)
        assert len(received) == total and set(received.values()) == {1}
        stats = server.statistics()
        assert stats.messages_stored == total and stats.redeliveries == 0 and stats.duplicates == 0


@pytest.mark.parametrize("flush", ["sync", "async"])
async def test_two_groups_each_receive_everything(tmp_path: Path, rt: SimpleNamespace, flush: str) -> None:
    async with (
        open_realtime_server(data_dir=tmp_path, clock=SystemClock(), flush=flush) as server,
        open_peers() as peers,
    ):
        producer = rt.peers_client(peers, server.address)
        sent = rt.messages(30)
        assert await producer.send(sent) == ["stored"] * 30
        for group in ("billing", "audit"):
            client = rt.peers_client(peers, server.address, group=group)
            pulled = await client.pull(100, **{"from": "earliest"})
            assert pulled.ids == [m.id for m in sent]
            assert [m.body for m in pulled.messages] == [m.body for m in sent]
            await client.ack(pulled.start, pulled.end)
            assert (await client.pull(100)).count == 0


async def test_broadcast_consumers_each_read_the_whole_log(tmp_path: Path, rt: SimpleNamespace) -> None:
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        producer = rt.peers_client(peers, server.address)
        await producer.send(rt.messages(10))
        a, b = (rt.peers_client(peers, server.address, group="cache", consumer=name) for name in "ab")
        first = await a.pull(100, broadcast=True, **{"from": "earliest"})
        second = await b.pull(100, broadcast=True, **{"from": "earliest"})
        assert first.ids == second.ids == [f"m{i:05d}" for i in range(10)]
        # A clustered group of the same name still shares one position.
        clustered = rt.peers_client(peers, server.address, group="cache", consumer="a")
        with pytest.raises(PeerError) as refused:
            await clustered.pull(100)
        assert refused.value.code == "bad_value" and refused.value.field == "broadcast"


def colliding_tags() -> tuple[str, str, str]:
    """Two tags sharing a mask bit, and a third with another bit."""
    seen: dict[int, str] = {}
    for number in range(10_000):
        tag = f"tag{number}"
        bit = tag_bit(tag)
        if bit in seen:
            first = seen[bit]
            other = next(t for t in (f"other{n}" for n in range(1000)) if tag_bit(t) != bit)
            return first, tag, other
        seen[bit] = tag
    raise AssertionError("no collision found")


async def test_tag_filter_runs_on_the_server_by_bitmask(tmp_path: Path, rt: SimpleNamespace) -> None:
    wanted, colliding, other = colliding_tags()
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        producer = rt.peers_client(peers, server.address)
        await producer.send(
            [
                Message("w", "orders", tags=(wanted,)),
                Message("x", "orders", tags=(other,)),
                Message("c", "orders", tags=(colliding,)),
                Message("n", "orders"),
                Message("both", "orders", tags=(other, wanted)),
            ]
        )
        client = rt.peers_client(peers, server.address)
        pulled = await client.pull(100, tags=[wanted], **{"from": "earliest"})
        # The colliding tag passes the bitmask: the client's exact filter drops it.
        assert pulled.ids == ["w", "c", "both"]
        # The skipped ones are consumed for the group: nothing is left.
        assert (await client.pull(100, tags=[wanted])).count == 0


async def test_long_poll_answers_the_moment_a_message_arrives(tmp_path: Path, rt: SimpleNamespace) -> None:
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        consumer = rt.peers_client(peers, server.address)
        producer = rt.peers_client(peers, server.address)
        assert (await consumer.pull(timeout_ms=0)).count == 0  # join at the latest entry
        answered: list[object] = []

        async def long_poll() -> None:
            answered.append(await consumer.pull(10, timeout_ms=30_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_poll)
            await rt.wait_until(lambda: server.statistics().pulls_waiting == 1)
            sent_at = trio.current_time()
            await producer.send(rt.messages(1))
            await rt.wait_until(lambda: bool(answered), timeout=30)
            elapsed = trio.current_time() - sent_at
        assert answered[0].ids == ["m00000"]  # type: ignore[attr-defined]
        assert elapsed < 10  # answered on arrival, not at the 30 s timeout


async def test_duplicate_ids_are_stored_once(tmp_path: Path, rt: SimpleNamespace) -> None:
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        producer = rt.peers_client(peers, server.address)
        first = rt.messages(3)
        assert await producer.send(first) == ["stored"] * 3
        retry = [first[1], Message("new", "orders"), Message("new", "orders")]
        assert await producer.send(retry) == ["duplicate", "stored", "duplicate"]
        pulled = await rt.peers_client(peers, server.address).pull(100, **{"from": "earliest"})
        assert pulled.ids == ["m00000", "m00001", "m00002", "new"]
        assert server.statistics().duplicates == 2


def frame_error(error: pytest.ExceptionInfo[PeerError]) -> tuple[str, str | None, object]:
    return error.value.code, error.value.field, error.value.limit


async def test_bad_input_is_refused_by_name_and_changes_nothing(tmp_path: Path, rt: SimpleNamespace) -> None:
    async with open_realtime_server(data_dir=tmp_path, clock=SystemClock()) as server, open_peers() as peers:
        client = rt.peers_client(peers, server.address)
        assert await client.send(rt.messages(2)) == ["stored", "stored"]
        pulled = await client.pull(1, **{"from": "earliest"})
        before = server.statistics()
        good = encode_message("ok", "orders")

        cases: list[tuple[object, tuple[str, str | None, object]]] = []
        with pytest.raises(PeerError) as error:
            await client.send_raw({}, good + _oversize_record())
        cases.append((error, ("limit", "body", 4 << 20)))
        with pytest.raises(PeerError) as error:
            await client.send_raw({}, good + _record_with_subject(b""))
        cases.append((error, ("limit", "subject", 255)))
        with pytest.raises(PeerError) as error:
            await client.send_raw({}, good + _record_with_subject(b"bad\x01subject"))
        cases.append((error, ("bad_value", "subject", None)))
        with pytest.raises(PeerError) as error:
            await client.send_raw({"priority": 1}, good)
        cases.append((error, ("bad_request", "priority", None)))
        with pytest.raises(PeerError) as error:
            await client.pull(10, colour="red")
        cases.append((error, ("bad_request", "colour", None)))
        with pytest.raises(PeerError) as error:
            await client.pull(0)
        cases.append((error, ("limit", "max", 1)))
        with pytest.raises(PeerError) as error:
            await rt.peers_client(peers, server.address, subject="").pull(1)
        cases.append((error, ("limit", "subject", 255)))
        with pytest.raises(PeerError) as error:
            await client.ack(pulled.end, pulled.end + 5)
        cases.append((error, ("unknown_pull", "end", 1)))
        with pytest.raises(PeerError) as error:
            await rt.peers_client(peers, server.address, consumer="never").ack(0, 1)
        cases.append((error, ("unknown_pull", "end", 0)))
        with pytest.raises(PeerError) as error:
            await client.ack(0, 1, when="now")
        cases.append((error, ("bad_request", "when", None)))
        for caught, expected in cases:
            assert frame_error(caught) == expected, caught.value  # type: ignore[arg-type]
        assert "[1, 6)" in str(cases[7][0].value)  # type: ignore[attr-defined]

        after = server.statistics()
        assert (after.messages_stored, after.message_log_end) == (before.messages_stored, before.message_log_end)
        # The server goes on: the good record of a refused batch was not stored, the rest is intact.
        assert await client.ack(pulled.start, pulled.end) == 1
        rest = await client.pull(10)
        assert rest.ids == ["m00001"] and rest.start == 1


def _record_with_subject(subject: bytes) -> bytes:
    """A message record whose subject is ``subject`` as is (bypassing the encoder's checks)."""
    header = struct.pack(">qqHHHBBHII", 0, 0, 0, 2, len(subject), 0, 0, 0, 0, 0)
    payload = header + b"id" + subject
    prefix = struct.pack(">IBBH", len(payload), 0xD7, 1, 1)
    return prefix + zlib.crc32(payload, zlib.crc32(prefix)).to_bytes(4, "big") + payload


def _oversize_record() -> bytes:
    """A well-formed record whose body is one byte over the default 4 MiB limit."""
    body = b"x" * ((4 << 20) + 1)
    header = struct.pack(">qqHHHBBHII", 0, 0, 0, 2, 6, 0, 0, 0, 0, len(body))
    payload = header + b"id" + b"orders" + body
    prefix = struct.pack(">IBBH", len(payload), 0xD7, 1, 1)
    return prefix + zlib.crc32(payload, zlib.crc32(prefix)).to_bytes(4, "big") + payload


async def test_registers_with_the_metaserver_when_given_its_address(tmp_path: Path, rt: SimpleNamespace) -> None:
    clock = SystemClock()
    async with open_metaserver(data_dir=tmp_path / "meta", clock=clock) as meta:
        async with (
            open_realtime_server(
                data_dir=tmp_path / "rt", clock=clock, meta_address=meta.address, group="rt-7"
            ) as server,
            open_peers() as peers,
        ):
            assert server.registration is not None
            with trio.fail_after(10):
                await server.registration.wait_registered()
            status = await peers.call(meta.address, Command.STATUS)
            rows = [row for row in status.metadata["rows"] if row["group"] == "rt-7"]
            assert [(row["kind"], row["address"], row["state"]) for row in rows] == [("realtime", server.address, "RW")]
            route = await peers.call(meta.address, Command.ROUTE, {"route": "consumer", "subject": "orders"})
            assert [group["address"] for group in route.metadata["groups"]] == [server.address]
