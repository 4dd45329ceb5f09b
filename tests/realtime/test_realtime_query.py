"""QUERY on a realtime server: stored or not, and each consumer group's state of a message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from delaymq.clock import TrioClock
from delaymq.metaserver.server import open_metaserver
from delaymq.net.testing import MemoryNetwork
from delaymq.protocol.cancel import MAX_IDS
from delaymq.protocol.commands import Command
from delaymq.protocol.errors import PeerError
from delaymq.protocol.records import encode_message
from delaymq.realtime.server import RealtimeServer, open_realtime_server
from delaymq.storage.threads import run_inline

EARLIEST = {"from": "earliest"}


async def query(client: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    frame = await client._call(Command.QUERY, {"ids": ids}, b"")
    results = frame.metadata["results"]
    assert [result["id"] for result in results] == ids
    return {result["id"]: result for result in results}


async def test_query_says_per_consumer_group_acked_handed_out_or_waiting(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    async with local.server(listen=None) as server:
        async with (
            rt.memory_client(server, group="acking", consumer="a1") as acking,
            rt.memory_client(server, group="holding", consumer="h1") as holding,
            rt.memory_client(server, group="idle", consumer="i1") as idle,
        ):
            assert (await idle.pull(10)).count == 0  # the group reads the subject, then never pulls again
            assert await acking.send(rt.messages(3)) == ["stored"] * 3
            taken = await acking.pull(10, **EARLIEST)
            assert taken.ids == ["m00000", "m00001", "m00002"]
            await acking.ack(taken.start, taken.start + 2)  # not the third
            assert (await holding.pull(10, **EARLIEST)).count == 3  # and no ack

            answer = await query(acking, ["m00000", "m00001", "m00002", "never-sent"])

    offsets = [answer[f"m0000{n}"]["offset"] for n in range(3)]
    assert offsets == sorted(offsets) and offsets[0] >= 0
    for n, acking_state in enumerate(["acked", "acked", "handed out"]):
        result = answer[f"m0000{n}"]
        assert result["stored"] is True
        assert result["subject"] == "orders"
        assert result["groups"] == {"acking": acking_state, "holding": "handed out", "idle": "waiting"}
    assert answer["never-sent"] == {"id": "never-sent", "stored": False, "groups": {}}


async def test_a_message_given_back_is_waiting_again_and_a_duplicate_is_found_at_its_first_copy(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    async with local.server(listen=None, ack_timeout_ms=5_000) as server:
        async with rt.memory_client(server, group="g", consumer="c") as client:
            assert await client.send(rt.messages(2)) == ["stored", "stored"]
            first = (await query(client, ["m00000"]))["m00000"]
            assert await client.send(rt.messages(1)) == ["duplicate"]
            taken = await client.pull(10, **EARLIEST)
            assert taken.count == 2
            assert (await query(client, ["m00000"]))["m00000"]["groups"] == {"g": "handed out"}
            await trio.sleep(6)  # past the ack timeout: given back to the group
            again = await query(client, ["m00000", "m00001"])
    assert again["m00000"]["offset"] == first["offset"]
    assert again["m00000"]["groups"] == again["m00001"]["groups"] == {"g": "waiting"}


async def test_bad_query_metadata_is_refused_naming_the_field(
    local: Any, rt: SimpleNamespace, autojump_clock: Any
) -> None:
    async with local.server(listen=None) as server, rt.memory_client(server) as client:
        cases: list[tuple[dict[str, Any], tuple[str, str, int | None]]] = [
            ({}, ("bad_request", "ids", None)),
            ({"ids": []}, ("bad_request", "ids", MAX_IDS)),
            ({"ids": [f"i{n}" for n in range(MAX_IDS + 1)]}, ("bad_request", "ids", MAX_IDS)),
            ({"ids": ["ok", 7]}, ("bad_request", "ids[1]", None)),
            ({"ids": ["ok"], "colour": "red"}, ("bad_request", "colour", None)),
            ({"subject": "orders", "key": "k"}, ("bad_request", "subject", None)),
        ]
        for metadata, (code, field, limit) in cases:
            with pytest.raises(PeerError) as refused:
                await client._call(Command.QUERY, metadata, b"")
            assert (refused.value.code, refused.value.field) == (code, field), metadata
            if limit is not None:
                assert refused.value.limit == limit


META, A, B = "meta.test:1", "rt-a.test:1", "rt-b.test:1"


@asynccontextmanager
async def master_and_slave(tmp: Path, clock: TrioClock) -> AsyncIterator[tuple[MemoryNetwork, RealtimeServer]]:
    """A realtime group of two on a memory network: yields the network and the slave (B)."""
    async with open_metaserver(listen=None, data_dir=tmp / "meta", clock=clock, run_blocking=run_inline) as meta:
        async with trio.open_nursery() as nursery:
            net = MemoryNetwork(nursery, timeout=30)
            net.serve(META, meta.serve_stream)
            members: dict[str, RealtimeServer] = {}

            async def run(address: str, *, task_status: Any) -> None:
                async with open_realtime_server(
                    data_dir=tmp / address, clock=clock, listen=None, advertise_address=address, meta_address=META,
                    group="rt1", run_blocking=run_inline, peers=net,
                ) as server:  # fmt: skip
                    net.serve(address, server.serve_stream)
                    task_status.started(server)
                    await trio.sleep_forever()

            for address in (A, B):
                members[address] = await nursery.start(run, address)
                with trio.fail_after(120):
                    while members[address].role != ("master" if address == A else "slave"):
                        await trio.sleep(0.01)
            yield net, members[B]
            nursery.cancel_scope.cancel()


async def test_a_slave_refuses_query_as_it_refuses_pull(tmp_path: Path, autojump_clock: Any) -> None:
    async with master_and_slave(tmp_path, TrioClock(1_749_996_000_000)) as (net, _slave):
        body = encode_message("m1", "orders", body=b"x", created_at=1_749_996_000_000)
        await net.call(A, Command.SEND, {}, body)
        answer = await net.call(A, Command.QUERY, {"ids": ["m1"]})
        assert answer.metadata["results"][0]["stored"] is True
        with pytest.raises(PeerError) as refused:
            await net.call(B, Command.QUERY, {"ids": ["m1"]})
    assert refused.value.code == "not_master"
    assert A in str(refused.value)
