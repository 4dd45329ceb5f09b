"""Fencing: a realtime server refuses a SEND of an older epoch of a scheduler group than one it has
seen, remembers the highest epoch durably before answering the SEND that raised it, and leaves
producers' SENDs (no fence) alone."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from delaymq.net.peers import open_peers
from delaymq.protocol.errors import PeerError
from delaymq.protocol.fencing import FENCED, Fence
from delaymq.protocol.records import encode_batch
from delaymq.realtime import RealtimeServer, open_realtime_server
from delaymq.realtime.fences import write_fences
from delaymq.storage.errors import StoreIOError
from delaymq.storage.threads import run_inline

T = TypeVar("T")

#: No checkpoint unless asked: what survives a crash is what the fence write committed itself.
OPTIONS: dict[str, Any] = {"checkpoint_interval_ms": 3_600_000}


def is_fence_write(function: Callable[[], object]) -> bool:
    return getattr(function, "func", None) is write_fences


class FenceWrites:
    """A ``run_blocking`` (inline) that counts fence writes and can hold them at a gate, or crash after one."""

    def __init__(self) -> None:
        self.count = 0
        self.gate: trio.Event | None = None  # set: writes wait for it
        self.held = trio.Event()  # a write is waiting at the gate
        self.crash_after: RealtimeServer | None = None
        self.failures = 0  # writes still to fail, as on a full disk

    async def __call__(self, function: Callable[[], T]) -> T:
        if is_fence_write(function):
            if self.gate is not None:
                self.held.set()
                await self.gate.wait()
            if self.failures:
                self.failures -= 1
                raise StoreIOError("state store: a write of 1 change(s) failed: No space left on device")
            self.count += 1
            result = await run_inline(function)
            if self.crash_after is not None:
                self.crash_after.crash()  # committed, not answered: as a SIGKILL right here
                await trio.sleep_forever()
            return result
        return await run_inline(function)


async def send(client: Any, group: str, epoch: int, messages: list[Any]) -> list[str]:
    frame = await client.send_raw(Fence(group, epoch).as_metadata(), encode_batch(messages))
    return frame.metadata["results"]


async def refused(client: Any, group: str, epoch: int, messages: list[Any]) -> PeerError:
    with pytest.raises(PeerError) as caught:
        await send(client, group, epoch, messages)
    return caught.value


async def everything(rt: SimpleNamespace, server: RealtimeServer) -> list[str]:
    """The ids a new consumer group finds in the subject from its start."""
    async with rt.memory_client(server, group="reader") as reader:
        return (await reader.pull(1000, **{"from": "earliest"})).ids


async def test_a_send_of_an_older_epoch_is_refused_and_nothing_of_it_is_stored(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    new, old = rt.messages(3, prefix="new"), rt.messages(3, prefix="old")
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert await send(client, "sched-1", 6, new) == ["stored"] * 3
        error = await refused(client, "sched-1", 5, old)
        assert (error.code, error.field, error.limit) == (FENCED, "fence.epoch", 6)
        assert "'sched-1'" in error.message and "epoch 5" in error.message and "epoch 6" in error.message
        assert await everything(rt, server) == [m.id for m in new]
        # Its ids were not taken into the dedup window: the new master's re-send of them is stored.
        assert await send(client, "sched-1", 6, old) == ["stored"] * 3
        status = await client.status()
        assert status["fences"] == {"sched-1": 6}
        assert status["statistics"]["fenced"] == 1 and status["statistics"]["messages_stored"] == 6


async def test_a_higher_epoch_is_accepted_and_remembered_and_an_equal_one_costs_no_write(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    writes = FenceWrites()
    async with (
        open_realtime_server(data_dir=local.data, clock=local.clock, run_blocking=writes, **OPTIONS) as server,
        rt.memory_client(server) as client,
    ):
        assert await send(client, "sched-1", 5, rt.messages(1, prefix="a")) == ["stored"]
        assert await send(client, "sched-1", 6, rt.messages(1, prefix="b")) == ["stored"]
        assert writes.count == 2
        for number in range(20):
            assert await send(client, "sched-1", 6, rt.messages(1, prefix=f"c{number}-")) == ["stored"]
        assert writes.count == 2  # the remembered epoch: a dict lookup, no disk write
        assert (await refused(client, "sched-1", 5, rt.messages(1, prefix="d"))).limit == 6
        assert server.statistics().fence_raises == 2


async def test_a_restarted_server_still_refuses_the_older_epoch(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert await send(client, "sched-1", 6, rt.messages(2, prefix="a")) == ["stored"] * 2
        server.crash()  # no last checkpoint: only what the SEND itself committed
        await trio.sleep_forever()
    assert server.crashed
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert (await client.status())["fences"] == {"sched-1": 6}
        assert (await refused(client, "sched-1", 5, rt.messages(1, prefix="b"))).limit == 6
        assert await send(client, "sched-1", 6, rt.messages(1, prefix="c")) == ["stored"]
        assert await everything(rt, server) == ["a00000", "a00001", "c00000"]


async def test_the_epoch_is_committed_before_the_send_that_raised_it_is_answered(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    writes = FenceWrites()
    answered = False
    async with (
        open_realtime_server(data_dir=local.data, clock=local.clock, run_blocking=writes, **OPTIONS) as server,
        rt.memory_client(server) as client,
    ):
        writes.crash_after = server  # the process dies after the commit, before the answer
        await send(client, "sched-1", 6, rt.messages(1, prefix="a"))
        answered = True
    assert server.crashed and not answered and writes.count == 1
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert (await refused(client, "sched-1", 5, rt.messages(1, prefix="b"))).limit == 6


async def test_a_raise_the_disk_cannot_take_is_refused_as_retryable_and_the_retry_stores_it(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    writes = FenceWrites()
    batch = rt.messages(2, prefix="a")
    async with (
        open_realtime_server(data_dir=local.data, clock=local.clock, run_blocking=writes, **OPTIONS) as server,
        rt.memory_client(server) as client,
    ):
        assert await send(client, "sched-1", 4, rt.messages(1, prefix="four")) == ["stored"]
        writes.failures = 1
        error = await refused(client, "sched-1", 5, batch)
        assert error.code == "unavailable" and "nothing of it was stored" in error.message
        assert await everything(rt, server) == ["four00000"]
        # Epoch 5 is on its way in: 4 is stale already; the retry of 5 commits it and stores the batch.
        assert (await refused(client, "sched-1", 4, rt.messages(1, prefix="x"))).code == FENCED
        assert await send(client, "sched-1", 5, batch) == ["stored"] * 2
        assert (await client.status())["fences"] == {"sched-1": 5}


async def test_racing_epochs_the_higher_waits_for_its_commit_and_the_lower_is_refused(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    writes = FenceWrites()
    async with (
        open_realtime_server(data_dir=local.data, clock=local.clock, run_blocking=writes, **OPTIONS) as server,
        rt.memory_client(server) as client,
    ):
        assert await send(client, "sched-1", 4, rt.messages(1, prefix="a")) == ["stored"]
        writes.gate = trio.Event()
        results: dict[int, Any] = {}

        async def sender(epoch: int, prefix: str) -> None:
            try:
                results[epoch] = await send(client, "sched-1", epoch, rt.messages(1, prefix=prefix))
            except PeerError as error:
                results[epoch] = error.code

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender, 5, "five")
            with trio.fail_after(10):
                await writes.held.wait()  # 5's raise is being written
            nursery.start_soon(sender, 6, "six")
            await trio.testing.wait_all_tasks_blocked()
            assert results == {}  # neither answered before its epoch is durable
            assert (await refused(client, "sched-1", 4, rt.messages(1, prefix="four"))).limit == 6
            writes.gate.set()
        # 5 was overtaken by 6 while its write ran: refused, nothing of it stored.
        assert results == {5: FENCED, 6: ["stored"]}
        assert (await client.status())["fences"] == {"sched-1": 6}
        assert (await refused(client, "sched-1", 5, rt.messages(1, prefix="late"))).limit == 6
        assert await everything(rt, server) == ["a00000", "six00000"]


async def test_producers_and_other_scheduler_groups_are_not_fenced(
    local: Any, rt: SimpleNamespace, autojump_clock: trio.testing.MockClock
) -> None:
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert await send(client, "sched-1", 9, rt.messages(1, prefix="a")) == ["stored"]
        assert await client.send(rt.messages(2, prefix="producer")) == ["stored"] * 2
        assert await send(client, "sched-2", 1, rt.messages(1, prefix="b")) == ["stored"]
        assert (await refused(client, "sched-2", 0, rt.messages(1, prefix="c"))).limit == 1  # its own group's epoch
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        assert (await client.status())["fences"] == {"sched-1": 9, "sched-2": 1}
        assert await client.send(rt.messages(1, prefix="after")) == ["stored"]


@pytest.mark.parametrize(
    ("metadata", "code", "field"),
    [
        ({"fence": {"group": "sched 1", "epoch": 3}}, "bad_metadata", "fence.group"),
        ({"fence": {"group": "sched-1", "epoch": -3}}, "bad_metadata", "fence.epoch"),
        ({"fence": {"group": "sched-1"}}, "bad_metadata", "fence.epoch"),
        ({"fence": [1, 2]}, "bad_metadata", "fence"),
        ({"fence": {"group": "sched-1", "epoch": 3}, "epoch": 3}, "bad_request", "epoch"),
    ],
)
async def test_malformed_fence_metadata_is_refused_naming_the_field(
    local: Any,
    rt: SimpleNamespace,
    autojump_clock: trio.testing.MockClock,
    metadata: dict[str, Any],
    code: str,
    field: str,
) -> None:
    async with local.server(**OPTIONS) as server, rt.memory_client(server) as client:
        with pytest.raises(PeerError) as caught:
            await client.send_raw(metadata, encode_batch(rt.messages(1)))
        assert (caught.value.code, caught.value.field) == (code, field)
        assert await everything(rt, server) == []
        assert (await client.status())["fences"] == {}


@pytest.mark.slow
async def test_sigkill_after_a_raise_keeps_the_older_epoch_refused(
    tmp_path: Any, rt: SimpleNamespace, server_processes: SimpleNamespace
) -> None:
    data = tmp_path / "realtime"
    data.mkdir()
    with trio.fail_after(60):
        async with open_peers() as peers:
            async with server_processes.realtime(data, **OPTIONS) as (address, _):
                client = rt.peers_client(peers, address)
                assert await send(client, "sched-1", 6, rt.messages(1, prefix="a")) == ["stored"]
            # SIGKILLed: no checkpoint was written after the SEND.
            async with server_processes.realtime(data, **OPTIONS) as (address, _):
                client = rt.peers_client(peers, address)
                error = await refused(client, "sched-1", 5, rt.messages(1, prefix="b"))
                assert (error.code, error.limit) == (FENCED, 6)
                reader = rt.peers_client(peers, address, group="reader")
                assert (await reader.pull(1000, **{"from": "earliest"})).ids == ["a00000"]
